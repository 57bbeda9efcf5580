"""``--ckpt-format torch_dist`` under ``--pipeline-schedule dualpipe``: the mirror (``model[1]``, keyed as
stage ``pp-1-i``) reads its stage's shards at load like any replica, and is never written: Megatron's
fully parallel save re-assigns ``replica_id = 0`` to every local shard ("Invalid access pattern"), and
the ``dp_reshardable`` optimizer state holds model[0]'s grad buffers only, as 1F1B's ("gbuf_idx_1").
"""

import functools

from ... import hooks
from ...hooks.mechanism import apply
from ...mcore.model import embedding_copy, unwrap_chunk
from ..refusal import Refusal
from .optimizers import home_buffers, inner_optimizers, is_distributed_optimizer, model0_ids

_SHARDED_STATE_DICT = hooks.entry("per object", "DistributedOptimizer.sharded_state_dict")
_LOAD_RESHARDABLE = hooks.entry("per object", "DistributedOptimizer.load_parameter_state_from_dp_reshardable")


class MirrorReplicaId(tuple):
    """A mirror entry's ``replica_id``: non-main, the original's length (Megatron asserts 3-tuples)."""


def mirror_replica_id(replica_id) -> MirrorReplicaId:
    ids = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return MirrorReplicaId((1 + ids[0], *ids[1:]) if ids else (1,))


def is_mirror_entry(value) -> bool:
    return isinstance(getattr(value, "replica_id", None), MirrorReplicaId)


def mark_mirror_replicas(chunk, only=None) -> None:
    """Make every sharded entry of ``chunk.sharded_state_dict(...)`` (or those under the top-level keys
    ``only``) a mirror replica, on the innermost module (Megatron unwraps first). Idempotent."""
    chunk = unwrap_chunk(chunk)
    if getattr(chunk, "_megatron_dualpipe_mirror_replica", False):
        return

    def marking(orig):
        @functools.wraps(orig)
        def sharded_state_dict(*a, **kw):
            sd = orig(*a, **kw)
            mark_non_main_replicas(sd if only is None else {k: v for k, v in sd.items() if k in only})
            return sd

        return sharded_state_dict

    apply(hooks.entry("per object", "GPTModel.sharded_state_dict").made_by(marking, on=chunk))
    chunk._megatron_dualpipe_mirror_replica = True


def mark_non_main_replicas(sharded_state_dict) -> int:
    """Give every sharded entry of the nested dict a :class:`MirrorReplicaId`; returns the count."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    n = 0
    for v in nested_values(sharded_state_dict):
        if isinstance(v, (ShardedBase, ShardedTensorFactory)) and hasattr(v, "replica_id"):
            v.replica_id = mirror_replica_id(v.replica_id)
            n += 1
    return n


def drop_mirror_entries(state_dict) -> int:
    """Replace every mirror entry of a state dict about to be saved by a non-persistent placeholder;
    returns the count."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    dropped = [0]

    def leave_out(v):
        if is_mirror_entry(v):
            dropped[0] += 1
            return LocalNonpersistentObject(None)
        return v

    dict_list_map_inplace(leave_out, state_dict)
    return dropped[0]


def mark_v_tied_output_weight(model) -> None:
    """DualPipeV, tied embeddings or MTP: V-stage 2pp-1's copy of rank 0's embedding (saved under its key)
    becomes a mirror replica: not written, loaded as its equal ("Invalid access pattern ... [[2]]")."""
    m0, m1, found = unwrap_chunk(model[0]), unwrap_chunk(model[1]), embedding_copy(model[1])
    if found is None or found[0] != "output" or not m0.pre_process:
        return
    key = "embedding.word_embeddings.weight" if getattr(m1, "mtp_process", False) else "output_layer.weight"
    mark_mirror_replicas(model[1], only=(key,))


# --- the distributed optimizer's dp_reshardable state: model[0]'s grad buffers only ---


def model0_distributed_optimizers(model, optimizer):
    """Within the block, each distributed optimizer's dp_reshardable state holds model[0]'s buffers only;
    at load the mirror's keep their values (``sync_mirrors`` fills them). Per object: the class is not changed."""
    swaps, keep_ids = [], model0_ids(model)
    for opt in (o for o in inner_optimizers(optimizer) if is_distributed_optimizer(o)):
        home = home_buffers(opt, keep_ids)  # model[0]'s must come first, as in a one-chunk run
        if home != list(range(len(home))):
            raise RuntimeError(f"--pipeline-schedule dualpipe: model[0]'s grad buffers are {home} of "
                               f"{len(opt.buffers)}, not the first ones; torch_dist cannot save them as a one-chunk "
                               "run does")
        n_home = len(home)
        if n_home == len(opt.buffers):
            continue
        swaps += [_SHARDED_STATE_DICT.to(_home_sharded_state_dict(opt, n_home), on=opt),
                  _LOAD_RESHARDABLE.to(_home_load(opt, n_home), on=opt)]
    return hooks.scoped(*swaps)


def _home_sharded_state_dict(opt, n_home):
    orig = type(opt).sharded_state_dict.__get__(opt)

    @functools.wraps(orig)
    def sharded_state_dict(model_sharded_state_dict={}, is_loading=False, sharding_type=None, metadata=None):  # noqa: B006 - Megatron's signature
        sd = orig(model_sharded_state_dict, is_loading, sharding_type, metadata)
        if sd.get("param_state_sharding_type") == "dp_reshardable":
            ps = sd["param_state"]
            for k in [k for k in ps if isinstance(k, int) and k >= n_home]:
                del ps[k]
            for key in ("per_bucket_numel", "per_bucket_numel_unpadded"):
                ps[key].data = ps[key].data[:n_home]
        return sd

    return sharded_state_dict


def _home_load(opt, n_home):
    orig = type(opt).load_parameter_state_from_dp_reshardable.__get__(opt)

    @functools.wraps(orig)
    def load_parameter_state_from_dp_reshardable(state_dict):
        state_dict = dict(state_dict)
        saved = state_dict.pop("per_bucket_numel_unpadded", None)
        if saved is not None and list(saved) != list(opt.per_bucket_numel_unpadded[:n_home]):
            raise Refusal(
                f"the checkpoint's distributed-optimizer buckets hold {saved} elements, this rank's model[0] "
                f"{opt.per_bucket_numel_unpadded[:n_home]} (DualPipe does not bucket its chunks; a 1f1b run with "
                "--overlap-grad-reduce does): save it with --dist-ckpt-optim-fully-reshardable, or load with "
                "--no-load-optim")
        current = opt.get_parameter_state_dp_reshardable()
        for k in range(n_home, len(opt.buffers)):
            state_dict[k] = {dtype: [[_as_loaded(t) for t in bucket] for bucket in buckets]
                             for dtype, buckets in current[k].items()}
        return orig(state_dict)

    return load_parameter_state_from_dp_reshardable


def _as_loaded(tensors):
    """One parameter's current state as ``load_parameter_state_from_dp_reshardable`` reads a loaded one."""
    out = {k: v for k, v in tensors.items() if k not in ("gbuf_local_start", "gbuf_local_end")}
    out["padding"] = False
    return out

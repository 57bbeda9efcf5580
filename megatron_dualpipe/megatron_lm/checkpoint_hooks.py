"""Checkpoints under ``--pipeline-schedule dualpipe``: the same logical model as 1F1B.

DualPipe holds every stage twice: ``model[0]`` is stage ``i`` on rank ``i`` (exactly the chunk
1F1B has there) and ``model[1]`` the mirrored copy of stage ``pp-1-i``, kept equal to its home
copy. A checkpoint therefore only needs ``model[0]``; the mirror is reconstructed at load.

Legacy ``--ckpt-format torch`` (one file per (tp, pp) rank, keys ``model`` and ``optimizer``):

* **save**: Megatron's ``save_checkpoint`` gets ``model[:1]`` and a view of the optimizer whose
  ``state_dict()`` keeps only ``model[0]``'s parameters (their Adam moments, step, and for
  fp16/bf16 the fp32 main copies), re-indexed as the one-chunk optimizer of a 1F1B run indexes
  them. The file is what a 1F1B run of the same model writes (plus ``args.pipeline_schedule``).
* **load**: Megatron's ``load_checkpoint`` gets ``model[:1]`` (so it reads the ``model`` key of
  a 1F1B or DualPipe checkpoint into ``model[0]``) and a view of the optimizer whose
  ``load_state_dict()`` expands the one-chunk state to both chunks: the saved entries go to
  ``model[0]``'s parameters, ``model[1]``'s get zero placeholders of the same structure. Then
  :func:`sync_mirrors` copies, over each bd pair, ``model[0]``'s parameters, fp32 main
  parameters and optimizer state on rank ``i`` into ``model[1]`` on rank ``pp-1-i``. After
  that, the mirror is bit-identical to its home copy in parameters *and* optimizer state, as it
  is in an uninterrupted DualPipe run (both copies always receive the same summed gradient).
* Supported optimizers: Megatron's ``FP32Optimizer`` and ``Float16OptimizerWithFloat16Params``
  (and a ``ChainedOptimizer`` of them, e.g. dense + expert parameters). The distributed optimizer
  saves its state in its own per-DP-rank file layout for this format: refused with a message
  (use ``--ckpt-format torch_dist``, or ``--no-save-optim`` / ``--no-load-optim``).

``--ckpt-format torch_dist``: keys are global (layer numbers, shard offsets), and ``model[1]`` is
built with the reversed pipeline group, so its keys are those of the stage it mirrors. Each of
``model[1]``'s sharded tensors and objects is marked a *non-main replica* (:func:`mark_mirror_replicas`:
``replica_id`` gets a leading 1), so validation sees exactly one main replica per shard (the home
copy's) and only the home copy is written; at load every replica reads the stored shard, so
``model[1]`` loads its stage from the home copy's data. The optimizer's sharded state is derived
from the model's sharded tensors and inherits the marks. After the load :func:`sync_mirrors` runs
as well (a no-op in value).

DualPipeV has no mirrors: its two chunks are different stages of a 2*pp-stage split, so its
torch-format files (keys ``model0``/``model1``, Megatron's own multi-chunk layout) cannot be
resumed under another schedule. Megatron itself would silently skip a chunk whose key is
missing, so a DualPipeV load of a torch-format file without ``model0``/``model1`` is refused
with a message. (torch_dist reshards by global keys; DualPipeV chunks carry vp_stage 0/1 keys,
not verified here.)
"""

import functools

from ..schedule import registry
from ..schedule.layout import BIDIRECTIONAL, V_SHAPE
from .training_hooks import schedule_of

_MARK = "_megatron_dualpipe_ckpt_hook"


def _layout_kind(args) -> str:
    return registry.get(schedule_of(args)).layout_kind


# ------------------------------------------------------------------------------------------
# Optimizer bookkeeping
# ------------------------------------------------------------------------------------------


def inner_optimizers(optimizer):
    """The megatron optimizers behind ``optimizer`` (the members of a ChainedOptimizer)."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _kind(opt) -> str:
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

    if isinstance(opt, Float16OptimizerWithFloat16Params):
        return "fp16"
    if isinstance(opt, FP32Optimizer):
        return "fp32"
    raise NotImplementedError(
        f"--pipeline-schedule dualpipe with --ckpt-format torch: optimizer {type(opt).__name__} is not "
        "supported (its state is saved in its own layout); use --ckpt-format torch_dist, or "
        "--no-save-optim / --no-load-optim"
    )


def _main_to_model(opt):
    """{id(main param): model param} for the parameters this optimizer updates."""
    if getattr(opt, "is_stub_optimizer", False) or opt.optimizer is None:
        return {}
    if _kind(opt) == "fp32":
        return {id(p): p for g in opt.optimizer.param_groups for p in g["params"]}
    m = {}
    for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
        for model_p, main_p in zip(model_group, main_group):
            m[id(main_p)] = model_p
    for group in opt.fp32_from_fp32_groups:
        for p in group:
            m[id(p)] = p
    return m


def _group_key(group):
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group[k] if k in group else group.get(f"pre_{k}") for k in param_group_identifier_keys)


def _masks(opt, keep_ids):
    """Per torch param group: which of its (main) params belong to a kept model param."""
    to_model = _main_to_model(opt)
    return [[id(to_model[id(p)]) in keep_ids for p in g["params"]] for g in opt.optimizer.param_groups]


def _torch_sd(opt, sd):
    return sd if _kind(opt) == "fp32" else sd["optimizer"]


def filter_state_dict(opt, sd, keep_ids):
    """``opt.state_dict()`` restricted to the params of ``keep_ids`` (model params), re-indexed;
    param groups left empty are dropped (a one-chunk optimizer would not have them)."""
    tsd = _torch_sd(opt, sd)
    masks = _masks(opt, keep_ids)
    if len(masks) != len(tsd["param_groups"]):
        raise RuntimeError("optimizer state dict and optimizer disagree on the number of param groups")
    state, groups, kept, idx = {}, [], [], 0
    for gi, (group, mask) in enumerate(zip(tsd["param_groups"], masks)):
        if len(group["params"]) != len(mask):
            raise RuntimeError("optimizer state dict and optimizer disagree on a param group's size")
        params = []
        for pid, keep in zip(group["params"], mask):
            if keep:
                if pid in tsd["state"]:
                    state[idx] = tsd["state"][pid]
                params.append(idx)
                idx += 1
        if params:
            groups.append(dict(group, params=params))
            kept.append(gi)
    new_tsd = {"state": state, "param_groups": groups}
    if _kind(opt) == "fp32":
        return new_tsd
    out = dict(sd)
    out["optimizer"] = new_tsd
    out["fp32_from_fp16_params"] = [
        [main for model_p, main in zip(opt.float16_groups[gi], sd["fp32_from_fp16_params"][gi]) if id(model_p) in keep_ids]
        for gi in kept
    ]
    return out


def expand_state_dict(opt, sd, keep_ids):
    """Inverse of `filter_state_dict`: a one-chunk state dict -> this optimizer's layout. The
    parameters outside ``keep_ids`` (the mirror) get zero placeholders (`sync_mirrors` fills them)."""
    import torch

    tsd = _torch_sd(opt, sd)
    saved_state = tsd["state"]
    template = next(iter(saved_state.values()), None)
    by_key = {}
    for si, g in enumerate(tsd["param_groups"]):
        by_key[_group_key(g)] = si
    masks = _masks(opt, keep_ids)
    fp16 = _kind(opt) == "fp16"
    state, groups, fp32_groups, used, idx = {}, [], [], set(), 0
    current = opt.optimizer.state_dict()["param_groups"]
    for gi, (cur, mask, live) in enumerate(zip(current, masks, opt.optimizer.param_groups)):
        n_keep = sum(mask)
        si = by_key.get(_group_key(cur)) if n_keep else None
        if n_keep and si is None:
            raise ValueError(
                f"checkpoint optimizer state has no parameter group {_group_key(cur)} (it has "
                f"{list(by_key)}): it was saved for a different model; resume with --no-load-optim")
        saved_group = tsd["param_groups"][si] if si is not None else None
        if saved_group is not None and len(saved_group["params"]) != n_keep:
            raise ValueError(
                f"checkpoint optimizer parameter group {_group_key(cur)} has {len(saved_group['params'])} "
                f"parameters, this rank's model[0] has {n_keep}: it was saved for a different model or "
                "pipeline split; resume with --no-load-optim")
        if si is not None:
            used.add(si)
        saved_ids = iter(saved_group["params"] if saved_group is not None else ())
        params = []
        for p, keep in zip(live["params"], mask):
            if keep:
                sid = next(saved_ids)
                if sid in saved_state:
                    state[idx] = saved_state[sid]
            elif template is not None:
                state[idx] = {
                    k: (torch.zeros_like(p.data, dtype=v.dtype) if torch.is_tensor(v) and v.dim() > 0
                        else (v.clone() if torch.is_tensor(v) else v))
                    for k, v in template.items()
                }
            params.append(idx)
            idx += 1
        groups.append(dict(saved_group if saved_group is not None else cur, params=params))
        if fp16:
            saved_mains = iter(sd["fp32_from_fp16_params"][si] if si is not None else ())
            fp32_groups.append([next(saved_mains) if id(model_p) in keep_ids else main
                                for model_p, main in zip(opt.float16_groups[gi], opt.fp32_from_float16_groups[gi])])
    unused = [i for i in range(len(tsd["param_groups"])) if i not in used]
    if unused:
        raise ValueError(
            f"checkpoint optimizer state has parameter groups this model does not have "
            f"({[_group_key(tsd['param_groups'][i]) for i in unused]}); resume with --no-load-optim")
    new_tsd = {"state": state, "param_groups": groups}
    if not fp16:
        return new_tsd
    out = dict(sd)
    out["optimizer"] = new_tsd
    out["fp32_from_fp16_params"] = fp32_groups
    return out


class _OneChunkOptimizerView:
    """Presents a DualPipe optimizer to Megatron's checkpoint code as a 1F1B (one-chunk) one."""

    def __init__(self, optimizer, keep_ids):
        self._optimizer = optimizer
        self._keep_ids = keep_ids
        self._inner = inner_optimizers(optimizer)

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def state_dict(self):
        sds = [filter_state_dict(o, o.state_dict(), self._keep_ids) for o in self._inner]
        return sds[0] if len(sds) == 1 else sds

    def load_state_dict(self, state_dict):
        if len(self._inner) == 1:
            self._optimizer.load_state_dict(expand_state_dict(self._inner[0], state_dict, self._keep_ids))
            return
        if isinstance(state_dict, dict):
            state_dict = [v for _, v in sorted(state_dict.items())]
        if len(state_dict) != len(self._inner):
            raise RuntimeError(f"expected {len(self._inner)} optimizer state dicts, got {len(state_dict)}")
        self._optimizer.load_state_dict([expand_state_dict(o, s, self._keep_ids)
                                         for o, s in zip(self._inner, state_dict)])


def _model0_ids(model):
    from ..mcore.model import unwrap_chunk

    return {id(p) for p in unwrap_chunk(model[0]).parameters()}


# ------------------------------------------------------------------------------------------
# Mirrors
# ------------------------------------------------------------------------------------------


def sync_mirrors(model, optimizer) -> None:
    """Home copy -> mirror, over each bd pair: parameters (``broadcast_mirrors``), then for every
    optimizer: fp32 main parameters and the optimizer state tensors, parameter by parameter in
    ``named_parameters`` order, stage min(i, pp-1-i) first. Collective within each bd pair."""
    import torch
    import torch.distributed as dist

    from ..mcore import groups
    from ..mcore.model import _flat_collective, broadcast_mirrors, unwrap_chunk

    broadcast_mirrors(model)
    pp_ranks = groups.get_pp_global_ranks()
    me = dist.get_rank()
    i, pp = pp_ranks.index(me), len(pp_ranks)
    mirror, bd_group = groups.get_bd_mirror_rank(), groups.get_bd_group()
    if mirror == me:
        raise NotImplementedError("sync_mirrors: DualPipe needs an even pipeline size")
    for opt in inner_optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False) or opt.optimizer is None:
            continue
        mains = {id(p): p for g in opt.optimizer.param_groups for p in g["params"]}
        to_model = _main_to_model(opt)
        model_to_main = {id(model_p): mains[main_id] for main_id, model_p in to_model.items()}
        for stage in sorted({i, pp - 1 - i}):
            chunk = model[0] if stage == i else model[1]
            src = me if stage == i else mirror
            tensors = []
            for _, p in unwrap_chunk(chunk).named_parameters():
                main = model_to_main.get(id(p))
                if main is None:
                    continue
                if main is not p:
                    tensors.append(main.data)
                st = opt.optimizer.state.get(main, {})
                tensors.extend(st[k] for k in sorted(st) if torch.is_tensor(st[k]))
            sig = [(tuple(t.shape), str(t.dtype)) for t in tensors]
            sigs = [None, None]
            dist.all_gather_object(sigs, sig, group=bd_group)
            if sigs[0] != sigs[1]:
                raise RuntimeError(
                    f"stage {stage}: the optimizer state of the two copies on ranks {groups.get_bd_ranks()} "
                    f"differs in structure ({len(sigs[0])} vs {len(sigs[1])} tensors)")
            if tensors:
                with torch.no_grad():
                    _flat_collective(tensors, lambda flat: dist.broadcast(flat, src=src, group=bd_group))


def mark_mirror_replicas(chunk) -> None:
    """torch_dist: make every ShardedTensor / ShardedObject of ``chunk.sharded_state_dict(...)``
    a non-main replica (``replica_id`` -> ``(1, *replica_id)``), by wrapping the method of the
    innermost module (Megatron's save/load call ``unwrap_model`` first). Idempotent."""
    from ..mcore.model import unwrap_chunk

    chunk = unwrap_chunk(chunk)  # Megatron's checkpointing calls unwrap_model(model) first
    if getattr(chunk, "_megatron_dualpipe_mirror_replica", False):
        return
    orig = chunk.sharded_state_dict

    @functools.wraps(orig)
    def sharded_state_dict(*a, **kw):
        sd = orig(*a, **kw)
        mark_non_main_replicas(sd)
        return sd

    chunk.sharded_state_dict = sharded_state_dict
    chunk._megatron_dualpipe_mirror_replica = True


def mark_non_main_replicas(sharded_state_dict) -> int:
    """Set ``replica_id = (1, *replica_id)`` on every ShardedBase in the nested dict; returns the count."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    n = 0
    for v in nested_values(sharded_state_dict):
        if isinstance(v, ShardedTensorFactory):
            v.replica_id = _non_main(v.replica_id)
            n += 1
        elif isinstance(v, ShardedBase) and hasattr(v, "replica_id"):
            v.replica_id = _non_main(v.replica_id)
            n += 1
    return n


def _non_main(replica_id):
    return (1, *replica_id) if isinstance(replica_id, tuple) else (1, replica_id)


# ------------------------------------------------------------------------------------------
# save_checkpoint / load_checkpoint
# ------------------------------------------------------------------------------------------


def _refuse_distributed_optimizer(args, what):
    if getattr(args, "use_distributed_optimizer", False):
        raise NotImplementedError(
            f"--pipeline-schedule dualpipe: {what} of the distributed optimizer's state in --ckpt-format torch "
            "is not supported; use --ckpt-format torch_dist, or pass "
            f"{'--no-save-optim' if what == 'saving' else '--no-load-optim'}")


def _wrap_save(orig):
    if getattr(orig, _MARK, False):
        return orig

    @functools.wraps(orig)
    def save_checkpoint(iteration, model, optimizer, *a, **kw):
        from megatron.training import get_args

        args = get_args()
        if _layout_kind(args) != BIDIRECTIONAL or args.ckpt_format != "torch":
            return orig(iteration, model, optimizer, *a, **kw)
        if not args.no_save_optim and optimizer is not None:
            _refuse_distributed_optimizer(args, "saving")
            for o in inner_optimizers(optimizer):
                if not getattr(o, "is_stub_optimizer", False):
                    _kind(o)  # refuses unsupported optimizers before anything is written
            optimizer = _OneChunkOptimizerView(optimizer, _model0_ids(model))
        return orig(iteration, list(model)[:1], optimizer, *a, **kw)

    setattr(save_checkpoint, _MARK, True)
    return save_checkpoint


def _disk_format(args, load_arg):
    """'torch_dist' if the checkpoint that load_checkpoint will read is a distributed one, else
    the format it will be read as (args.ckpt_format when nothing can be found)."""
    try:
        import megatron.training.checkpointing as mckpt
        from megatron.core import dist_checkpointing

        load_dir = getattr(args, load_arg, None)
        tracker = mckpt.get_checkpoint_tracker_filename(load_dir)
        import os

        if not load_dir or not os.path.isfile(tracker):
            return args.ckpt_format
        iteration, release = mckpt.read_metadata(tracker)
        if getattr(args, "ckpt_step", None):
            iteration = args.ckpt_step
        name = mckpt.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
        return "torch_dist" if dist_checkpointing.check_is_distributed_checkpoint(name) else "torch"
    except Exception:  # noqa: BLE001 - detection is best effort; Megatron reports real errors
        return args.ckpt_format


def _check_dualpipev_torch_checkpoint(args, load_arg):
    """DualPipeV + torch format: Megatron silently skips chunks whose ``model%d`` key is missing,
    so refuse a checkpoint that was not written by a two-chunk (DualPipeV) run."""
    import os

    import torch

    import megatron.training.checkpointing as mckpt

    load_dir = getattr(args, load_arg, None)
    tracker = mckpt.get_checkpoint_tracker_filename(load_dir) if load_dir else None
    if not tracker or not os.path.isfile(tracker):
        return
    iteration, release = mckpt.read_metadata(tracker)
    if getattr(args, "ckpt_step", None):
        iteration = args.ckpt_step
    name = mckpt.get_checkpoint_name(load_dir, iteration, release)
    if not os.path.isfile(name):
        return
    sd = torch.load(name, map_location="cpu", weights_only=False, mmap=True)
    if "model0" not in sd or "model1" not in sd:
        saved = getattr(sd.get("args"), "pipeline_schedule", registry.DEFAULT)
        raise NotImplementedError(
            f"--pipeline-schedule dualpipev cannot resume {name} (written by --pipeline-schedule {saved}) in "
            "--ckpt-format torch: DualPipeV splits the layers into 2*pp stages, so its per-rank files hold "
            "different layers; convert through --ckpt-format torch_dist (which reshards by global keys)")


def _wrap_load(orig):
    if getattr(orig, _MARK, False):
        return orig

    @functools.wraps(orig)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, **kw):
        from megatron.training import get_args

        args = get_args()
        layout_kind = _layout_kind(args)
        if layout_kind == V_SHAPE and _disk_format(args, load_arg) == "torch":
            _check_dualpipev_torch_checkpoint(args, load_arg)
        if layout_kind != BIDIRECTIONAL:
            return orig(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, **kw)
        fmt = _disk_format(args, load_arg)
        if fmt == "torch":
            load_optim = optimizer is not None and not args.no_load_optim and not args.finetune
            view = optimizer
            if optimizer is not None:
                if load_optim:
                    _refuse_distributed_optimizer(args, "loading")
                view = _OneChunkOptimizerView(optimizer, _model0_ids(ddp_model))
            result = orig(list(ddp_model)[:1], view, opt_param_scheduler, load_arg, strict, **kw)
        else:
            result = orig(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, **kw)
        sync_mirrors(ddp_model, optimizer)
        return result

    setattr(load_checkpoint, _MARK, True)
    return load_checkpoint


def install():
    """Patch ``megatron.training.training``'s by-name ``save_checkpoint`` / ``load_checkpoint``."""
    import megatron.training.training as mtraining

    mtraining.save_checkpoint = _wrap_save(mtraining.save_checkpoint)
    mtraining.load_checkpoint = _wrap_load(mtraining.load_checkpoint)

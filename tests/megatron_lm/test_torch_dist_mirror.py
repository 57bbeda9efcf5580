"""DualPipe's mirror in a torch_dist state dict (megatron_lm/checkpoint/torch_dist_mirror.py), without a run:
marked non-main with Megatron's replica-id shape, still recognisable after Megatron copies a model
entry into the optimizer's state (``dataclasses.replace``), and left out of what is saved."""
import dataclasses

import pytest
import torch

mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")

from megatron_dualpipe.megatron_lm.checkpoint import torch_dist_mirror as tdm  # noqa: E402
from megatron_dualpipe.megatron_lm.refusal import Refusal  # noqa: E402


def _tensor(key, replica_id):
    return mapping.ShardedTensor.from_rank_offsets(key, torch.zeros(2, 3), replica_id=replica_id)


def test_mirror_marks_are_non_main_keep_their_length_and_survive_copies():
    home = {"embedding.word_embeddings.weight": _tensor("embedding.word_embeddings.weight", (0, 0, 1))}
    mirror = {"output_layer.weight": _tensor("embedding.word_embeddings.weight", (1, 0, 1)),
              "layer": _tensor("decoder.layers.0.weight", (0, 0, 0)),
              "obj": mapping.ShardedObject("x/_extra_state", None, (1,), (0,), replica_id=0)}
    assert tdm.mark_non_main_replicas(mirror) == 3
    ids = {k: v.replica_id for k, v in mirror.items()}
    print(f"\nmirror replica ids: {ids}")
    assert ids == {"output_layer.weight": (2, 0, 1), "layer": (1, 0, 0), "obj": (1,)}
    assert not any(mapping.is_main_replica(r) for r in ids.values())
    assert all(tdm.is_mirror_entry(v) for v in mirror.values()) and not tdm.is_mirror_entry(home["embedding.word_embeddings.weight"])
    # Megatron's optimizer state of a parameter: the model entry copied under another key
    optimizer = {"state": {0: {"exp_avg": dataclasses.replace(mirror["layer"], key="optimizer.state.exp_avg.x")},
                           1: {"exp_avg": dataclasses.replace(home["embedding.word_embeddings.weight"], key="y"),
                               "step": torch.tensor(3.0)}}}
    assert tdm.is_mirror_entry(optimizer["state"][0]["exp_avg"])

    state = {"model0": home, "model1": mirror, "optimizer": optimizer}
    assert tdm.drop_mirror_entries(state) == 4
    assert all(isinstance(v, mapping.LocalNonpersistentObject) for v in mirror.values())
    assert isinstance(optimizer["state"][0]["exp_avg"], mapping.LocalNonpersistentObject)
    assert isinstance(home["embedding.word_embeddings.weight"], mapping.ShardedTensor)
    assert isinstance(optimizer["state"][1]["exp_avg"], mapping.ShardedTensor)


class _FakeDistributedOptimizer:
    """What the dp_reshardable load wrapper reads of Megatron's DistributedOptimizer: two buffers
    (model[0]'s, then the mirror's), one bucket each, one parameter per bucket."""

    def __init__(self, per_bucket_numel_unpadded):
        self.per_bucket_numel_unpadded = per_bucket_numel_unpadded
        self.buffers = [object(), object()]
        self.loaded = None

    def get_parameter_state_dp_reshardable(self):
        return {k: {torch.float32: [[{"param": torch.full((2,), float(k)), "gbuf_local_start": 0, "gbuf_local_end": 2}]]}
                for k in range(2)}

    def load_parameter_state_from_dp_reshardable(self, state_dict):
        self.loaded = state_dict


def test_dp_reshardable_load_keeps_the_mirror_buffers_and_refuses_other_buckets():
    opt = _FakeDistributedOptimizer([[6], [6]])
    saved = {"per_bucket_numel_unpadded": [[6]], 0: {torch.float32: [[{"param": torch.ones(2), "padding": False}]]}}
    tdm._home_load(opt, 1)(saved)
    print(f"\nloaded buffers: {sorted(k for k in opt.loaded if isinstance(k, int))}; mirror's: {opt.loaded[1]}")
    assert opt.loaded[0] is saved[0] and "per_bucket_numel_unpadded" not in opt.loaded
    (mirror,) = opt.loaded[1][torch.float32][0]
    assert mirror["padding"] is False and "gbuf_local_start" not in mirror and mirror["param"].tolist() == [1.0, 1.0]

    bucketed = dict(saved, per_bucket_numel_unpadded=[[4, 2]])
    with pytest.raises(RuntimeError, match="--dist-ckpt-optim-fully-reshardable.*--no-load-optim") as err:
        tdm._home_load(_FakeDistributedOptimizer([[6], [6]]), 1)(bucketed)
    print(f"refused: {err.value}")
    assert isinstance(err.value, Refusal)  # said once by the launcher, not a traceback per rank

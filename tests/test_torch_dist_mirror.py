"""DualPipe's mirror in a torch_dist state dict (megatron_lm/torch_dist_mirror.py), without a run:
marked non-main with Megatron's replica-id shape, still recognisable after Megatron copies a model
entry into the optimizer's state (``dataclasses.replace``), and left out of what is saved."""
import dataclasses

import pytest
import torch

mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")

from megatron_dualpipe.megatron_lm import torch_dist_mirror as tdm  # noqa: E402


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

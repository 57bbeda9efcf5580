"""Megatron-Bridge's own ``pretrain()`` under DualPipe and DualPipeV, against Bridge's own 1F1B.

A tiny GPT recipe (``bridge_recipe.py``: untied embeddings here, tied ones below, the TE layer spec through the CPU mode's
stand-ins, the distributed optimizer, overlapped gradient reduction, an evaluation) trains on 4 gloo
processes (pp=4) through Bridge's ``pretrain``: its own, and the package's drop-in with
``schedule="dualpipe"`` / ``"dualpipev"``. Every metric Bridge logs is compared, each iteration.
The tiny MoE recipe (expert parallel 2 x pp=2 x dp=2, alltoall, aux loss and z-loss, one MTP layer) and
tensor parallel 2 with sequence parallelism x pp=2
the same way, its MoE and MTP lines included (both with tied embeddings); torch_dist checkpoints chained
through Bridge's 1F1B, dualpipe and dualpipev against an uninterrupted 1F1B run (``test_bridge_checkpoint.py``).
Skipped where Megatron-Bridge is not installed (docs/megatron-bridge.md says how to make its venv).
"""
from __future__ import annotations

import pytest

import bridge_recipe
from bridge_compare import WHY_NOT, compare, run_ranks

#: smoke: CI's oldest tier installs Bridge 0.3.1 (BRIDGE=0.3.1 scripts/setup_venv.sh) and runs these
pytestmark = [pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "-"), pytest.mark.smoke]


def test_dualpipe_and_dualpipev_log_what_bridges_1f1b_logs_untied():
    """pp=4, untied embeddings (the Llama 3 and DeepSeek-V3 recipes'); tied ones at pp=4 are the checkpoint
    chain's (``test_bridge_checkpoint.py``), at pp=2 the MoE and TP cases'."""
    logged = run_ranks(bridge_recipe.train_each, bridge_recipe.PP,
                       args=(("bridge-1f1b", "dualpipe", "dualpipev"), False), timeout=600)[-1]
    compare(logged, {"bridge-1f1b": [None], "dualpipe": [3, 0], "dualpipev": [3, 4]})


def test_moe_with_expert_parallel_and_mtp_logs_what_bridges_1f1b_logs():
    """The tiny MoE (expert parallel 2 x pp=2 x dp=2, alltoall, aux loss and z-loss, one MTP layer):
    Bridge's MoE and MTP lines (load_balancing_loss, z_loss, mtp_1 loss) compared with the rest."""
    logged = run_ranks(bridge_recipe.train_each, 4,
                       args=(("bridge-1f1b", "dualpipe", "dualpipev"), True, "moe"), timeout=600)[-1]
    worst = compare(logged, {"bridge-1f1b": [None], "dualpipe": [1, 0], "dualpipev": [1, 2]})
    for schedule, gaps in worst.items():
        assert {"loss/load_balancing_loss", "loss/z_loss", "loss/mtp_1 loss"} <= set(gaps), (schedule, sorted(gaps))


def test_tensor_parallel_with_sequence_parallelism_logs_what_bridges_1f1b_logs():
    """Tensor parallel 2 with sequence parallelism x pp=2 (TE layers through the CPU mode's stand-in):
    the recipes' TP, every metric against Bridge's 1F1B."""
    logged = run_ranks(bridge_recipe.train_each, 4,
                       args=(("bridge-1f1b", "dualpipe", "dualpipev"), True, "tp2"), timeout=600)[-1]
    compare(logged, {"bridge-1f1b": [None], "dualpipe": [1, 0], "dualpipev": [1, 2]})

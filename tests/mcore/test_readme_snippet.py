"""docs/megatron-core.md's megatron-core snippet, taken literally, gives megatron-core 1F1B's gradients.

docs/megatron-core.md tells users to build the bd groups and the two-direction model, wrap each chunk in
megatron-core DDP and call ``get_forward_backward_func("dualpipe")`` -- and it never sets
``config.finalize_model_grads_func``. DualPipe must still sum the two copies of each stage (that
sum is part of DualPipe, not of Megatron's finalize): otherwise each copy keeps the gradient of
only its own direction's micro-batches.

Reference: in the same processes and from the same weights, megatron-core's own 1F1B
(``schedules.get_forward_backward_func()``) over one DDP-wrapped stage per rank, also without a
finalize function, on the same micro-batches. Rank i's model[0] (stage i) must match 1F1B's stage
i, and model[1] (the mirror of stage pp-1-i) must match rank pp-1-i's.
"""
from __future__ import annotations

import pytest
import torch

from harness import megatron_env as me
from megatron_dualpipe.proof import models
from megatron_dualpipe.proof.compare import Gap
from megatron_dualpipe.proof.data import forward_step

from test_dualpipe_megatron import MBS, SEQ, spec

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")

PP, M = 4, 8


def _ddp(chunk):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    return DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk)


def _main_grads(chunk):
    return {n: p.main_grad.detach().clone() for n, p in chunk.module.named_parameters()}


def _worker(rank, world, port):
    from megatron.core.pipeline_parallel import schedules

    from megatron_dualpipe.mcore.forward_backward import get_forward_backward_func
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import build_two_direction_model

    me.init_distributed_cpu(rank, world, port, pp=world)
    try:
        torch.manual_seed(1234)
        # --- the snippet of docs/megatron-core.md -------------------------------------------------
        build_bd_groups()
        provider = models.provider(spec())
        model = build_two_direction_model(provider)
        model = [_ddp(chunk) for chunk in model]
        assert all(chunk.config.finalize_model_grads_func is None for chunk in model)
        forward_backward = get_forward_backward_func("dualpipe")
        forward_backward(forward_step_func=forward_step, data_iterator=iter(spec().batches(M)), model=model,
                         num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS)
        dual = [_main_grads(chunk) for chunk in model]
        # --- megatron-core's own 1F1B from the same weights -----------------------------------------
        stage = _ddp(provider())
        stage.module.load_state_dict(model[0].module.state_dict())
        assert stage.config.finalize_model_grads_func is None
        schedules.get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(spec().batches(M)), model=[stage],
            num_microbatches=M, seq_length=SEQ, micro_batch_size=MBS)
        return dual, _main_grads(stage)
    finally:
        me.destroy_distributed()


def test_readme_snippet_matches_megatron_1f1b():
    results = me.run_workers(_worker, PP, timeout=300)
    gap = Gap()
    for rank, (dual, ref) in enumerate(results):
        mirror_ref = results[PP - 1 - rank][1]
        for chunk, want in ((0, ref), (1, mirror_ref)):
            got = dual[chunk]
            assert set(got) == set(want)
            for name in want:
                diff = gap.add(got[name], want[name], f"rank {rank} model[{chunk}] {name}")
                assert diff < 1e-5, f"rank {rank} model[{chunk}] {name}: relative difference {diff:.2e}"
    print(f"\nREADME snippet, dualpipe pp={PP} M={M}, no finalize function, against megatron-core 1F1B: "
          + gap.line("every gradient of both chunks") + f"; largest per-tensor relative difference {gap.worst:.2e}")

"""The bytes per rank that DualPipe logs at the start of training (``mcore/state_bytes.py``) against a
direct count, and its 1F1B column against Megatron's 1F1B built for real in the same configuration.

pp=2, dp=2 (4 gloo processes), a tiny GPT, two configurations: bf16 parameters with the distributed
optimizer (fp32 main parameters sharded over dp) and fp32 parameters without it. The direct count
reads Megatron's objects another way: DDP's buffers (``param_data``, ``grad_data``), each model
parameter's ``main_param``, and the inner optimizer's ``state`` after a step of it; the 1F1B
reference builds the rank's own stage alone, with its own DDP and optimizer, as Megatron's 1F1B
does. Every number is printed.
"""
from __future__ import annotations

import pytest
import torch

from harness import megatron_env as me
from megatron_dualpipe.proof import models

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")]

LAYERS = 4


def _build(chunks_of, dist_opt, bf16):
    """Megatron DDP around each chunk (unbucketed, as DualPipe's get_model does) and Megatron's optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=True) for c in chunks_of]
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16, use_distributed_optimizer=dist_opt,
                             params_dtype=torch.bfloat16 if bf16 else torch.float32)
    return wrapped, get_megatron_optimizer(config, wrapped, use_gloo_process_groups=False)


def _spec(bf16):
    """The tiny GPT with ``bf16`` in its config (fp32 parameters: ``_half`` makes them bf16, as Megatron-LM does)."""
    return models.ModelSpec(layers=LAYERS, config=(("bf16", bf16),))


def _half(chunks, bf16):
    """With ``bf16``, megatron-core's ``Float16Module`` around each chunk (every parameter bf16), as
    Megatron-LM's get_model wraps them for --bf16."""
    from megatron.core.transformer.module import Float16Module

    return [Float16Module(c.config, c) for c in chunks] if bf16 else list(chunks)


def _inner(optimizer):
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _step_inner(optimizer):
    """What Megatron's step ends in: the inner torch optimizer stepping on the main parameters
    (zero gradients), so that its per-parameter state exists."""
    for inner in _inner(optimizer):
        for g in inner.param_groups:
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()


def _direct(chunk, optimizer, dist_opt, bf16):
    """(params, grads, main params, optimizer state) of one DDP chunk, read another way."""
    buffers = list(chunk.buffers) + list(chunk.expert_parallel_buffers)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    params = [p for p in chunk.parameters()]
    param_bytes = sum(nbytes(b.param_data) for b in buffers) if dist_opt else sum(nbytes(p) for p in params)
    grad_bytes = sum(nbytes(b.grad_data) for b in buffers)
    # bf16: Megatron's fp32 copy (with the distributed optimizer: this rank's shard; None where
    # the whole parameter lies in another rank's shard); fp32: the optimizer steps on the parameter
    mains = [getattr(p, "main_param", None) if bf16 else p for p in params]
    mains = [m for m in mains if m is not None]
    main_bytes = sum(nbytes(m) for m in mains) if bf16 else 0
    states = {}
    for inner in _inner(optimizer):
        states.update(inner.state)
    entries = [(k, t) for m in mains for k, t in states.get(m, {}).items() if isinstance(t, torch.Tensor)]
    state_bytes = sum(nbytes(t) for _, t in entries)
    steps = sum(nbytes(t) for k, t in entries if k == "step")  # Adam's step counters (not predicted)
    return [param_bytes, grad_bytes, main_bytes, state_bytes], steps


def _worker(rank, world, port, dist_opt, bf16):
    from megatron.core import parallel_state as ps

    from megatron_dualpipe.mcore import state_bytes
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import broadcast_mirrors, build_two_direction_model

    me.init_distributed_cpu(rank, world, port, pp=2)
    try:
        build_bd_groups()
        model = build_two_direction_model(models.provider(_spec(bf16)), layout_kind="bidirectional")
        broadcast_mirrors(model)
        model, opt = _build(_half(model, bf16), dist_opt, bf16)
        pp_rank = ps.get_pipeline_model_parallel_rank()
        before = state_bytes.rank_bytes(model, opt)
        rows_before, allocated_before = state_bytes.gather_table(model, opt, pp_rank)
        _step_inner(opt)
        after = state_bytes.rank_bytes(model, opt)
        rows, allocated = state_bytes.gather_table(model, opt, pp_rank)
        direct, steps = zip(*[_direct(c, opt, dist_opt, bf16) for c in model])
        real = [sum(p.numel() for p in c.parameters()) for c in model]
        # Megatron's 1F1B: this rank's stage alone, its own DDP and optimizer
        one = models.provider(_spec(bf16))(ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
        one, one_opt = _build(_half([one], bf16), dist_opt, bf16)
        _step_inner(one_opt)
        reference, _ = _direct(one[0], one_opt, dist_opt, bf16)
        text = state_bytes.format_table("dualpipe", rows, allocated) if rank == 0 else None
        return {"pp": pp_rank, "dp": ps.get_data_parallel_rank(), "before": [c.values() for c in before.chunks],
                "after": [c.values() for c in after.chunks],
                "allocated": (before.state_allocated, after.state_allocated, allocated_before, allocated),
                "direct": list(direct), "steps": list(steps), "real": real, "reference": reference, "text": text,
                "rows": [(r.pp_rank, r.mine.values(), r.one_f_one_b.values()) for r in rows],
                "rows_before": [(r.pp_rank, r.mine.values(), r.one_f_one_b.values()) for r in rows_before]}
    finally:
        me.destroy_distributed()


@pytest.mark.parametrize("dist_opt,bf16", [(True, True), (False, False)], ids=["bf16-distributed-optimizer", "fp32"])
def test_logged_bytes_match_a_direct_count_and_megatrons_1f1b(dist_opt, bf16):
    got = me.run_workers(_worker, world_size=4, args=(dist_opt, bf16), timeout=300)
    print(f"\n{got[0]['text']}")
    for g in got:
        print(f"pp {g['pp']} dp {g['dp']}: counted {g['after']}, direct {g['direct']}, 1F1B built alone "
              f"{g['reference']} (params, grads, main params, optimizer state)")
        assert g["allocated"] == (False, True, False, True)
        assert g["after"] == g["direct"]
        # before the first step the per-parameter state is predicted: Adam's two moments, each like
        # the main parameter; the step allocates them (and a step counter per parameter)
        for before, after, steps in zip(g["before"], g["after"], g["steps"]):
            assert before[:3] == after[:3] and before[3] == after[3] - steps
        assert g["after"][0] == g["reference"]  # model[0] is what 1F1B holds
    for pp in (0, 1):
        mine = [g for g in got if g["pp"] == pp]
        if bf16:  # the fp32 main copies of a chunk, summed over its dp shards: 4 bytes per parameter
            for c in (0, 1):
                assert sum(g["after"][c][2] for g in mine) == 4 * mine[0]["real"][c]
        row = next(r for r in got[0]["rows"] if r[0] == pp)
        largest = [max(sum(g["after"][c][i] for c in (0, 1)) for g in mine) for i in range(4)]
        assert row[1] == largest and row[2] == [max(g["reference"][i] for g in mine) for i in range(4)]
        total, one = sum(row[1]), sum(row[2])
        assert f"{total:,}" in got[0]["text"] and f"{one:,}" in got[0]["text"]
        print(f"pipeline rank {pp}: {total:,} bytes, 1F1B {one:,} ({total / one:.2f}x)")

"""The advice logged from a real run's first training iteration (``advise=True``, Megatron-LM's
``--dualpipe-advise``): the measured per-op costs, activation and parameter memory, and the log.

The activation figure is checked against an independent count: one process runs the whole
model's forward for one micro-batch and counts the bytes autograd saves (parameters excluded).
Each rank measures its stages' share, so the logged value (the largest rank's, per micro-batch
per stage) must lie between the whole model's count / pp and the whole count; counting the
parameters too (the mistake it guards against) would exceed the whole count several times.
"""
from __future__ import annotations

import logging

import pytest
import torch

from harness import megatron_env as me
from megatron_dualpipe.proof import models
from megatron_dualpipe.proof.data import forward_step
from test_dualpipe_megatron import MBS, SEQ, spec

from megatron_dualpipe.mcore.live_advice import DEFAULT_WARMUP, LiveAdvice, advice_text, cost_problem
from megatron_dualpipe.mcore.live_advice import stage_parameter_bytes
from megatron_dualpipe.executor.trace import op_medians, slowest_costs

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")


def test_op_medians_and_slowest_costs():
    record = {"actions": [{"op": "F", "dir": 0, "mb": 0, "stage": 0}, {"op": "F", "dir": 0, "mb": 1, "stage": 0},
                          {"op": "F", "dir": 0, "mb": 2, "stage": 0}, {"op": "B", "dir": 0, "mb": 0, "stage": 0},
                          {"op": "W", "dir": 0, "mb": 0, "stage": 0}, {"op": "F", "dir": 1, "mb": 0, "stage": 1},
                          {"op": "B", "dir": 0, "mb": 1, "stage": 0}],
              "units": [[[0], 0.0, 0.0, 0.010], [[1], 0.0, 0.010, 0.040], [[2], 0.04, 0.05, 0.062],
                        [[3], 0.0, 0.1, 0.125], [[4], 0.0, 0.2, 0.207], [[5, 6], 0.0, 0.3, 0.36]]}
    medians = op_medians(record)
    print(medians)
    assert medians == pytest.approx({"F": 12.0, "B": 25.0, "W": 7.0, "FB": 60.0})
    costs = slowest_costs([medians, {"F": 15.0, "B": 20.0, "W": 9.0}])
    assert (costs.f, costs.b, costs.w, costs.fb) == pytest.approx((15.0, 34.0, 9.0, 60.0))  # b = B + W


def test_op_medians_pool_several_iterations():
    """The advice pools the measured iterations' units: the median over all of them."""
    def record(f_ms):
        return {"actions": [{"op": "F", "dir": 0, "mb": i, "stage": 0} for i in range(len(f_ms))],
                "units": [[[i], 0.0, 0.0, ms / 1e3] for i, ms in enumerate(f_ms)]}
    pooled = op_medians(record([10.0, 11.0]), record([12.0, 13.0]), record([100.0]))
    print(pooled)
    assert pooled == pytest.approx({"F": 12.0})


def test_warm_up_iterations_are_not_recorded():
    """The first ``warmup`` training calls get no recorder: their units (every one of them slowed by
    one-time costs) never reach the medians; the next calls are recorded."""
    advice = LiveAdvice(warmup=2, measured=2)
    model = [torch.nn.Linear(2, 2)]
    got = []
    for _ in range(4):
        with advice.measuring(model) as recorder:
            got.append(recorder)
    print(f"recorders per call: {[type(r).__name__ for r in got]}; measured {advice.iterations()}")
    assert got[:2] == [None, None] and all(r is not None for r in got[2:])
    assert advice.iterations() == "iterations 3-4" and DEFAULT_WARMUP >= 2


@pytest.mark.parametrize("per_op,refused", [
    ({"F": 97.6, "B": 28.5, "W": 10.0, "FB": 60.0}, True),    # what a first iteration measured
    ({"F": 10.0, "B": 12.0, "W": 5.0, "FB": 11.0}, True),     # cheaper than B alone
    ({"F": 10.0, "B": 12.0, "W": 5.0, "FB": 15.0}, False),    # overlap gain: between max and sum
    ({"F": 10.0, "BW": 20.0, "FB": 30.0}, False),
    ({"F": 10.0, "B": 12.0, "W": 5.0}, False),                 # no fused units: nothing to compare
])
def test_costs_a_fused_unit_cannot_have_are_not_advised_from(per_op, refused):
    problem = cost_problem(per_op)
    print(f"\n{per_op}: {problem}")
    assert (problem is not None) == refused
    if refused:
        assert "--dualpipe-advise-warmup" in problem and "less than F" in problem


def test_stage_parameter_bytes_counts_gradients_and_adam_state():
    fp32, bf16 = torch.nn.Linear(10, 4), torch.nn.Linear(10, 4).to(torch.bfloat16)
    assert stage_parameter_bytes(fp32) == 44 * (4 + 4 + 8)
    assert stage_parameter_bytes(bf16) == 44 * (2 + 4 + 8 + 4)


def test_advice_text_names_the_choice():
    text = advice_text("dualpipe", 4, 16, {"F": 10.0, "B": 10.0, "W": 10.0}, 2 * 2**20, 100 * 2**20, None)
    print(text)
    assert text.startswith("advice for pp=4, M=16 from training iterations of dualpipe")
    assert "M=16: use " in text and "f=10 b=20 w=10" in text


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _whole_model_activation_bytes(rank, world, port):
    """One process, the whole model (pp=1), one micro-batch: bytes autograd saves for backward."""
    me.init_distributed_cpu(rank, world, port, pp=1)
    try:
        model = models.provider(spec())(True, True)
        params = {p.data_ptr() for p in model.parameters()}
        saved = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                saved[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output, loss_func = forward_step(iter(spec().batches(1)), model)
            loss_func(output)
        return sum(saved.values())
    finally:
        me.destroy_distributed()


def _advising_worker(rank, world, port, schedule):
    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import broadcast_mirrors, build_two_direction_model

    me.init_distributed_cpu(rank, world, port, pp=world)
    handler = _Lines()
    logger = logging.getLogger("megatron_dualpipe")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        build_bd_groups()
        model = build_two_direction_model(models.provider(spec()), layout_kind="bidirectional")
        broadcast_mirrors(model)
        for chunk in model:
            chunk.config.finalize_model_grads_func = lambda *a, **k: None
        for forward_only in (True, False, False, False, False):  # evaluation first: not measured
            with torch.no_grad() if forward_only else torch.enable_grad():
                forward_backward_dualpipe(forward_step_func=forward_step, data_iterator=iter(spec().batches(8)),
                                          model=model, num_microbatches=8, seq_length=SEQ, micro_batch_size=MBS,
                                          forward_only=forward_only, schedule=schedule, p2p_timeout=60,
                                          advise=True, advise_warmup=1)
        return [line for line in handler.lines if "advice for" in line or "no advice from" in line]
    finally:
        logger.removeHandler(handler)
        me.destroy_distributed()


def test_first_training_iteration_logs_advice_once_on_rank_0():
    [whole] = me.run_workers(_whole_model_activation_bytes, 1, timeout=120)
    pp = 4
    logged = me.run_workers(_advising_worker, pp, args=("dualpipe",), timeout=300)
    print(logged[0][0] if logged[0] else logged)
    assert [len(x) for x in logged] == [1, 0, 0, 0]
    text = logged[0][0]
    assert "advice for pp=4, M=8 from training iterations 2-4 of dualpipe, the first 1 skipped as warm-up" in text
    assert "\nM=8: use " in text
    # The links were timed on the job's groups: P2P between neighbours and the pair sum (dp=1 here).
    comm_line = next(line for line in text.splitlines() if line.startswith("communication (ms): "))
    assert "measured P2P " in comm_line and "pair sum " in comm_line and " exposed " in text
    memory_line = next(line for line in text.splitlines() if line.startswith("memory: activations "))
    activation_mib = float(memory_line.split()[2])
    got = activation_mib * 2**20
    print(f"activations per micro-batch per stage: logged {got:.0f} B; whole model one micro-batch {whole} B, "
          f"/ pp = {whole / pp:.0f} B")
    assert whole / pp <= got <= whole


def test_the_model_of_the_running_job_reduces_as_it_does():
    """The live advice models the job's own reduction: the distributed optimizer (reduce-scatter),
    --overlap-grad-reduce, and how DualPipe's copies are summed (read off the chunks that
    --dualpipe-dp-first / --dualpipe-shared-shard-group build)."""
    from types import SimpleNamespace

    from megatron_dualpipe.mcore.copies.dp_first import DP_FIRST_ATTR
    from megatron_dualpipe.mcore.copies.shared_shard import SHARED_ATTR
    from megatron_dualpipe.mcore.live_advice import reduction_of

    def chunk(dist_opt, overlap, **marks):
        return SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=dist_opt,
                                                          overlap_grad_reduce=overlap), **marks)

    cases = {"plain": ([chunk(False, False)] * 2, (False, False, "bd-first")),
             "dp-first": ([chunk(True, True, **{DP_FIRST_ATTR: True})] * 2, (True, True, "dp-first")),
             "shared": ([chunk(True, False, **{SHARED_ATTR: True})] * 2, (True, False, "shared-shard")),
             "no DDP": ([SimpleNamespace()] * 2, (False, True, "bd-first"))}
    for name, (model, want) in cases.items():
        got = reduction_of(model)
        print(name, got)
        assert (got["distributed_optimizer"], got["overlap_grad_reduce"], got["bd_mode"]) == want

"""mcore.grad_reduction: GradReduction starts each data-parallel reduction where the plan says.

The iteration plan decides where every rank starts each chunk's data-parallel reduction
(``IterationPlan.dp_points``) and checks its collectives there; GradReduction must start them at
exactly those points, in that order, reading the same data. Driven on the CPU with plain chunks
(no process group: schedules without bd sums) the way the runner drives it, the points where
``config.grad_sync_func`` is called are recorded and compared with the plan. A plan that starts a
reduction before the chunk's gradients are final, or never, is refused with an error, not run.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_dualpipe.mcore.grad_reduction import GradReduction
from megatron_dualpipe.mcore.model import V_SHAPE
from megatron_dualpipe.schedule import build_schedule, iteration_plan as IP, lowered, program, registry
from megatron_dualpipe.schedule.comm import plan


@pytest.fixture(autouse=True)
def _one_rank(tmp_path):
    """A one-rank gloo group: GradReduction names the rank in what it tells the watchdog."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _setup(name, pp, m):
    spec = registry.get(name)
    s = build_schedule(name, pp, spec.padded_microbatches(pp, m))
    plans = plan(s.layout, s.ranks)
    ip = IP.plan_for(spec, pp, m, s.ranks, plans, zero_bubble=True, overlap_grad_reduce=True, dp=2)
    is_fake = lambda a: spec.is_fake(m, a.dir, a.mb)  # noqa: E731
    ops = IP.grad_ops(spec.defers_weight_grads and any(a.op == "W" for r in s.ranks for a in r))
    return s, ip, is_fake, ops, plans


def _chunks(n, layout):
    chunks = [torch.nn.Linear(2, 2) for _ in range(n)]
    for d, c in enumerate(chunks):
        c.dualpipe_chunk_info = dict(layout=layout, direction=d, stage=d, num_stages=n)
    return chunks


def _program(s, ip, plans, r, is_fake, dp_points):
    """Rank r's program with the reductions at ``dp_points`` (a test's misorder: the plan's elsewhere)."""
    base = lowered.lower(r, plans[r], s.ranks[r], [is_fake(a) for a in s.ranks[r]])
    return program.rank_program(base, s.layout, r, s.ranks[r], plans[r].units, is_fake, sum_points=ip.sum_points[r],
                                dp_points=dp_points, param_gather=False, forward_only=False)


def _drive(actions, units, model, ops, last):
    """Run GradReduction as the runner and ``mcore.program_ops`` do, op by op of the program;
    [(action index after which, chunk)] of its starts (``len(actions)``: after the schedule)."""
    started, at = [], [0]

    def grad_sync_func(params):
        ids = [id(p) for p in params]
        started.append((at[0], next(c for c, chunk in enumerate(model) if [id(p) for p in chunk.parameters()] == ids)))

    config = SimpleNamespace(grad_sync_func=grad_sync_func, finalize_model_grads_func=None)
    reduction = GradReduction(model, config, actions=actions, last_actions=last)
    for op in ops:
        if op.kind == lowered.RUN:
            for i in units[op.index]:
                at[0] = i
                reduction.after_action(actions[i])
        elif op.kind == lowered.FINISH:
            at[0] = len(actions)
            reduction.end_schedule()
        elif op.kind in (lowered.SUM, lowered.SUMMED, lowered.DP):
            reduction.on_reduction(op.kind, op.index)
    reduction.complete()
    return started


@pytest.mark.parametrize("name,pp,m", [("dualpipev", 4, 9), ("dualpipev", 4, 8), ("executor-1f1b", 4, 6),
                                       ("zb-h1", 4, 8)])
def test_grad_sync_starts_at_the_plans_points(name, pp, m):
    s, ip, is_fake, ops, plans = _setup(name, pp, m)
    for r, actions in enumerate(s.ranks):
        last = IP.last_grad_action_index(actions, is_fake, ops)
        model = _chunks(len(s.layout.directions), V_SHAPE if s.layout.kind == V_SHAPE else s.layout.kind)
        got = _drive(actions, plans[r].units, model, ip.ops[r], last)
        print(f"{name} pp={pp} M={m} rank {r}: grad_sync_func after actions {got}; plan {ip.dp_points[r]}")
        assert got == ip.dp_points[r]
    assert any(i < len(s.ranks[r]) for r in range(pp) for i, _ in ip.dp_points[r])  # some overlap the schedule


def test_a_plan_starting_a_reduction_too_early_or_never_is_refused():
    s, ip, is_fake, ops, plans = _setup("dualpipev", 4, 8)
    actions, units = s.ranks[1], plans[1].units
    last = IP.last_grad_action_index(actions, is_fake, ops)
    c = ip.dp_points[1][0][1]
    early = [(last[c] - 1 if cc == c else i, cc) for i, cc in ip.dp_points[1]]
    with pytest.raises(RuntimeError, match=f"data-parallel reduction of chunk {c} before its gradients are final"):
        _drive(actions, units, _chunks(2, V_SHAPE), _program(s, ip, plans, 1, is_fake, early), last)
    never = [p for p in ip.dp_points[1] if p[1] != c]
    with pytest.raises(RuntimeError, match=r"starts no data-parallel reduction of chunk\(s\) \[" + str(c)):
        _drive(actions, units, _chunks(2, V_SHAPE), _program(s, ip, plans, 1, is_fake, never), last)

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
from megatron_dualpipe.schedule import build_schedule, iteration_plan as IP, registry
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
    ip = IP.plan_for(spec, pp, m, s.ranks, plan(s.layout, s.ranks), zero_bubble=True, overlap_grad_reduce=True, dp=2)
    is_fake = lambda a: spec.is_fake(m, a.dir, a.mb)  # noqa: E731
    ops = IP.grad_ops(spec.defers_weight_grads and any(a.op == "W" for r in s.ranks for a in r))
    return s, ip, is_fake, ops


def _chunks(n, layout):
    chunks = [torch.nn.Linear(2, 2) for _ in range(n)]
    for d, c in enumerate(chunks):
        c.dualpipe_chunk_info = dict(layout=layout, direction=d, stage=d, num_stages=n)
    return chunks


def _drive(actions, model, sum_points, dp_points, last):
    """Run GradReduction as the runner does; [(action index after which, chunk)] of its starts."""
    started, at = [], [0]

    def grad_sync_func(params):
        ids = [id(p) for p in params]
        started.append((at[0], next(c for c, chunk in enumerate(model) if [id(p) for p in chunk.parameters()] == ids)))

    config = SimpleNamespace(grad_sync_func=grad_sync_func, finalize_model_grads_func=None)
    reduction = GradReduction(model, config, actions=actions, sum_points=sum_points, dp_points=dp_points,
                              last_actions=last)
    ops: dict = {}  # the program's sum / dp ops after each action (lowered.with_reductions, one-action units)
    for i, c in sum_points:
        ops.setdefault(i, []).append(("sum", c))
    for i, c in dp_points:
        ops.setdefault(i, []).append(("dp", c))
    for i, a in enumerate(actions):
        at[0] = i
        reduction.after_action(a)
        for kind, c in ops.get(i, ()):
            reduction.on_reduction(kind, c)
    at[0] = len(actions)
    reduction.finish()
    return started


@pytest.mark.parametrize("name,pp,m", [("dualpipev", 4, 9), ("dualpipev", 4, 8), ("executor-1f1b", 4, 6),
                                       ("zb-h1", 4, 8)])
def test_grad_sync_starts_at_the_plans_points(name, pp, m):
    s, ip, is_fake, ops = _setup(name, pp, m)
    for r, actions in enumerate(s.ranks):
        last = IP.last_grad_action_index(actions, is_fake, ops)
        model = _chunks(len(s.layout.directions), V_SHAPE if s.layout.kind == V_SHAPE else s.layout.kind)
        got = _drive(actions, model, ip.sum_points[r], ip.dp_points[r], last)
        print(f"{name} pp={pp} M={m} rank {r}: grad_sync_func after actions {got}; plan {ip.dp_points[r]}")
        assert got == ip.dp_points[r]
    assert any(i < len(s.ranks[r]) for r in range(pp) for i, _ in ip.dp_points[r])  # some overlap the schedule


def test_a_plan_starting_a_reduction_too_early_or_never_is_refused():
    s, ip, is_fake, ops = _setup("dualpipev", 4, 8)
    actions = s.ranks[1]
    last = IP.last_grad_action_index(actions, is_fake, ops)
    c = ip.dp_points[1][0][1]
    early = [(last[c] - 1 if cc == c else i, cc) for i, cc in ip.dp_points[1]]
    with pytest.raises(RuntimeError, match=f"data-parallel reduction of chunk {c} before its gradients are final"):
        _drive(actions, _chunks(2, V_SHAPE), [], early, last)
    with pytest.raises(RuntimeError, match=r"starts no data-parallel reduction of chunk\(s\) \[" + str(c)):
        _drive(actions, _chunks(2, V_SHAPE), [], [p for p in ip.dp_points[1] if p[1] != c], last)

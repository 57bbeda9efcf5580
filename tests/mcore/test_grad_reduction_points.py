"""mcore.grad_reduction: GradReduction starts each data-parallel reduction where the plan says.

The program decides where every rank starts each chunk's data-parallel reduction
(``Program.dp_points``, ``lowering.reductions``), and the iteration plan checks its collectives
there; GradReduction must start them at exactly those points, in that order, reading the same
data. Driven on the CPU with plain chunks
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
from megatron_dualpipe.schedule import iteration_plan as IP, registry
from megatron_dualpipe.schedule.lowering import OpKind
from megatron_dualpipe.schedule.lowering.program import ProgramOptions, build_program
from megatron_dualpipe.schedule.lowering.reductions import final_points, grad_ops, last_grad_action_index, place_reductions


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
    options = ProgramOptions(overlap_grad_reduce=True, dp=2)
    prog = IP.plan_for(build_program(name, pp, registry.get(name).padded_microbatches(pp, m), m, False, options)).program
    return prog, grad_ops(prog.deferring)


def _chunks(n, layout):
    chunks = [torch.nn.Linear(2, 2) for _ in range(n)]
    for d, c in enumerate(chunks):
        c.dualpipe_chunk_info = dict(layout=layout, direction=d, stage=d, num_stages=n)
    return chunks


def _program(prog, r, dp_points):
    """Rank r's program with the reductions at ``dp_points`` (a test's misorder: the plan's elsewhere)."""
    strip = (OpKind.FINAL, OpKind.SUM, OpKind.SUMMED, OpKind.SETTLE, OpKind.DP)
    base = tuple(op for op in prog.ops[r] if op.kind not in strip)
    finals = final_points(prog.actions[r], prog.padded.is_fake, grad_ops(prog.deferring), len(prog.layout.directions))
    return place_reductions(base, prog.actions[r], prog.plans[r].units, prog.sum_points[r], dp_points, finals)


def _drive(units, model, ops, end):
    """Run GradReduction as ``mcore.program_ops`` does, op by op of the program; [(action index
    after which, chunk)] of its starts (``end``, the number of actions: after the schedule)."""
    started, at = [], [0]

    def grad_sync_func(params):
        ids = [id(p) for p in params]
        started.append((at[0], next(c for c, chunk in enumerate(model) if [id(p) for p in chunk.parameters()] == ids)))

    config = SimpleNamespace(grad_sync_func=grad_sync_func, finalize_model_grads_func=None)
    reduction = GradReduction(model, config)
    for op in ops:
        if op.kind == OpKind.RUN:
            at[0] = units[op.index][-1]
        elif op.kind == OpKind.FINISH:
            at[0] = end
        elif op.kind in (OpKind.FINAL, OpKind.SUM, OpKind.SUMMED, OpKind.SETTLE, OpKind.DP):
            reduction.on_reduction(op.kind, op.index)
    reduction.complete()
    return started


@pytest.mark.parametrize("name,pp,m", [("dualpipev", 4, 9), ("dualpipev", 4, 8), ("executor-1f1b", 4, 6),
                                       ("zb-h1", 4, 8)])
def test_grad_sync_starts_at_the_plans_points(name, pp, m):
    prog, _ = _setup(name, pp, m)
    layout = prog.layout
    for r, actions in enumerate(prog.actions):
        model = _chunks(len(layout.directions), V_SHAPE if layout.kind == V_SHAPE else layout.kind)
        got = _drive(prog.plans[r].units, model, prog.ops[r], len(actions))
        print(f"{name} pp={pp} M={m} rank {r}: grad_sync_func after actions {got}; plan {prog.dp_points[r]}")
        assert got == list(prog.dp_points[r])
    assert any(i < len(prog.actions[r]) for r in range(pp) for i, _ in prog.dp_points[r])  # some overlap the schedule


def test_a_plan_starting_a_reduction_too_early_or_never_is_refused():
    prog, ops = _setup("dualpipev", 4, 8)
    actions, units = prog.actions[1], prog.plans[1].units
    last = last_grad_action_index(actions, prog.padded.is_fake, ops)
    c = prog.dp_points[1][0][1]
    early = [(last[c] - 1 if cc == c else i, cc) for i, cc in prog.dp_points[1]]
    with pytest.raises(RuntimeError, match=f"data-parallel reduction of chunk {c} before its gradients are final"):
        _drive(units, _chunks(2, V_SHAPE), _program(prog, 1, early), len(actions))
    never = [p for p in prog.dp_points[1] if p[1] != c]
    with pytest.raises(RuntimeError, match=r"starts no data-parallel reduction of chunk\(s\) \[" + str(c)):
        _drive(units, _chunks(2, V_SHAPE), _program(prog, 1, never), len(actions))


def _tied_chunks():
    """DualPipeV rank 0's two chunks with a tied word embedding: stage 0 holds the input embedding,
    the last stage the output weight (the fold at ``settle`` sums their gradients)."""
    first, last = _chunks(2, V_SHAPE)
    first.pre_process, first.share_embeddings_and_output_weights = True, True
    first.embedding = torch.nn.Module()
    first.embedding.word_embeddings = torch.nn.Linear(2, 2)
    last.post_process, last.share_embeddings_and_output_weights = True, True
    last.output_layer = torch.nn.Linear(2, 2)
    return [first, last]


def test_a_reduction_started_before_the_settle_that_folds_its_chunk_is_refused():
    """The tied fold changes both end chunks' gradients at ``settle``: the plan starts their reductions
    after it (dualpipev rank 0 holds both ends); one started right after the chunk's last gradient
    action, before the settle, would reduce a gradient the fold still changes."""
    prog, ops = _setup("dualpipev", 4, 8)
    actions = prog.actions[0]
    end, last = len(actions), last_grad_action_index(actions, prog.padded.is_fake, ops)
    print(f"dualpipev pp=4 M=8 rank 0: reductions at {prog.dp_points[0]} (end {end}), last gradient actions {last}")
    assert all(i == end for i, _ in prog.dp_points[0])
    model = _tied_chunks()
    early = [(last[c], c) for _, c in prog.dp_points[0]]
    reduction = GradReduction(model, SimpleNamespace(grad_sync_func=lambda params: None,
                                                     finalize_model_grads_func=lambda *a, **k: None))
    with pytest.raises(RuntimeError, match="before its gradients are final"):
        for op in _program(prog, 0, early):
            if op.kind in (OpKind.FINAL, OpKind.SUM, OpKind.SUMMED, OpKind.SETTLE, OpKind.DP):
                reduction.on_reduction(op.kind, op.index)

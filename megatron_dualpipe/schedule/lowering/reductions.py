"""The reductions pass: where each rank issues its bd sums and starts its data-parallel reductions.

Why: a chunk's gradients are final at its last real gradient action; the bd pair must sum the
stages in the same order, and every data-parallel replica must start each reduction at the same
point (their collectives pair up by position), so both are data of the program, never a poll of a
sum's completion. The iteration plan checks them; ``costs.comm_cost`` reads the same points.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Callable, Dict, List, Sequence, Tuple

from ..actions import Action
from ..layout import Layout
from .ops import Op, OpKind

#: A point: (action index, chunk); index ``len(actions)``: at the end of the schedule.
Point = Tuple[int, int]


def grad_ops(deferring: bool) -> Tuple[str, str]:
    """The ops that finish a chunk's weight gradients: deferring (zero bubble), a B leaves them to its W."""
    return ("BW", "W") if deferring else ("B", "BW")


def last_grad_action_index(actions: Sequence[Action], is_fake: Callable, ops: Sequence[str]) -> Dict[int, int]:
    """{chunk: index of its last real gradient action}: where its gradients are final."""
    last = {}
    for k, a in enumerate(actions):
        if a.op in ops and not is_fake(a):
            last[a.dir] = k
    return last


def completion_order(actions: Sequence[Action], is_fake: Callable, ops: Sequence[str]) -> List[int]:
    """The chunks of a rank in the order their gradients become final (chunks without a real
    gradient action last)."""
    last = last_grad_action_index(actions, is_fake, ops)
    return sorted(last, key=last.get) + [c for c in (0, 1) if c not in last]


def bd_sum_order(actions, partner_actions, is_fake: Callable, ops, lower_rank: bool) -> List[int]:
    """This rank's chunks in the order both partners issue the sums (the partner's chunk 1-c is
    this rank's chunk c): the order in which the chunks finish when it is the same on both
    (DualPipe's symmetry), else the lower rank's, so that the pair's collectives match."""
    mine = completion_order(actions, is_fake, ops)
    theirs = [1 - c for c in completion_order(partner_actions, is_fake, ops)]
    return mine if mine == theirs or lower_rank else theirs


def bd_sum_points(actions, partner_actions, is_fake: Callable, ops, lower_rank: bool,
                  at_end: bool = False) -> List[Point]:
    """[(action index, chunk)] in issue order: each sum right after the later of its chunk's last
    gradient action and the previous sum's point; ``len(actions)``: at the end of the schedule
    (no real gradient action, or ``at_end``: ``iteration_plan.plan_for``)."""
    last = {} if at_end else last_grad_action_index(actions, is_fake, ops)
    order = bd_sum_order(actions, partner_actions, is_fake, ops, lower_rank)
    return list(zip(accumulate((last.get(c, len(actions)) for c in order), max), order))


def dp_start_points(layout: Layout, r: int, actions, is_fake: Callable, ops, *,
                    bd_sums: bool = True) -> List[Point]:
    """[(action index, chunk)] in start order: where rank ``r`` starts each chunk's data-parallel
    reduction, right after its last real gradient action unless its gradients still change after
    the schedule (summed copies, the middle rank's local sum, the tied-embedding fold of a rank
    holding both ends): then at ``len(actions)`` (``GradReduction.finish``). Ties in finish order."""
    end, last = len(actions), last_grad_action_index(actions, is_fake, ops)
    chunks = range(len(layout.directions))
    stages = layout.stages_on(r)
    firsts = [c for c in chunks if layout.is_first(layout.directions[c], stages[c])]
    lasts = [c for c in chunks if layout.is_last(layout.directions[c], stages[c])]
    folded = set(firsts + lasts) if firsts and lasts else set()
    summed = layout.mirrored and (bd_sums or layout.partner(r) == r)
    at = {c: end if summed or c in folded else last.get(c, end) for c in chunks}
    return sorted(((at[c], c) for c in chunks), key=lambda p: (p[0], last.get(p[1], end), p[1]))


def final_points(actions: Sequence[Action], is_fake: Callable, ops: Sequence[str], chunks: int) -> List[Point]:
    """[(action index, chunk)]: where each chunk's gradient actions are done (``len(actions)``:
    it has no real one), in that order."""
    last = last_grad_action_index(actions, is_fake, ops)
    return sorted((last.get(c, len(actions)), c) for c in range(chunks))


def place_reductions(ops: Sequence[Op], actions: Sequence[Action], units: Sequence[Tuple[int, ...]],
                     sum_points: Sequence[Point], dp_points: Sequence[Point],
                     finals: Sequence[Point] = ()) -> Tuple[Op, ...]:
    """``ops`` with ``final C`` / ``sum C`` / ``dp C`` after the ``run`` of the unit holding each
    point's action and, after ``finish``, those of the end, the ``summed C`` waits in issue order,
    ``settle`` (training), then the end's reductions; a reduction started after its chunk's sum in
    the schedule waits for that sum first."""
    end, sum_at = len(actions), {c: i for i, c in sum_points}
    early = {c for i, c in dp_points if sum_at.get(c, end) <= i < end}
    after: Dict[int, List[Op]] = {}
    for i, c in finals:
        after.setdefault(i, []).append(Op(OpKind.FINAL, c))
    for i, c in sum_points:
        after.setdefault(i, []).append(Op(OpKind.SUM, c))
    after.setdefault(end, []).extend(Op(OpKind.SUMMED, c) for _, c in sum_points if c not in early)
    after[end] += [Op(OpKind.SETTLE)] if dp_points else []
    for i, c in dp_points:
        after.setdefault(i, []).extend([Op(OpKind.SUMMED, c), Op(OpKind.DP, c)] if c in early else [Op(OpKind.DP, c)])
    out: List[Op] = []
    run, finish = OpKind.RUN, OpKind.FINISH
    for op in ops:
        out.append(op)
        if op.kind is run:
            for i in units[op.index]:
                out += after.get(i, ())
        elif op.kind is finish:
            out += after.get(end, ())
    return tuple(out)

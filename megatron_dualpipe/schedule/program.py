"""One rank's whole program: the lowered schedule with the collectives issued around it.

Why: ``lowered.lower`` gives a rank's P2P batches, their waits and its compute; the code around
the runner issues more collectives every iteration (the parameter all-gathers, the bd sums, the
data-parallel reductions, the loss gather, the finalize), and each was placed by a rule of its
own module and re-enacted by the iteration plan. Here they become ops of the same list, at
the points the plan decides, so the runner and the Megatron glue execute what the check reads.

:func:`rank_program` adds to the lowered ops, in one pass:

* ``gather C`` for every chunk with a real forward, before the first op, in the order of the
  chunks' first real forwards (one communicator runs them in issue order; a gather no forward
  waits for would still be in flight at the next iteration), and ``gathered C`` right before the
  ``run`` of the unit holding that first forward (DDP's pre-hook waits there);
* ``sum C`` / ``dp C`` after the ``run`` of the unit holding each point's action (the plan's
  (action index, chunk) points, in their order: per action its sums, then its reductions), a
  ``summed C`` right after each sum where the stream waits at once (``wait_at_issue``, the code
  before issue 17's fix, kept to show the check finds that cycle), else before a reduction the
  plan starts after its chunk's sum in the schedule (none in a plan of ``dp_start_points``);

and after ``finish``: the sums the plan leaves to the end, every sum waited in issue order, the
reductions planned there, the loss gather (the final stage's owner of each direction sends its
entries to rank pp-1), then, training, the finalize's token-count all-reduce over the pipeline
(two chunks: ``mcore.finalize``) and Megatron's ``finalize``. Standard library only.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

from .actions import F, Action
from .layout import Layout
from .lowered import (COLL, DP, FINALIZE, GATHER, GATHERED, LOSS_RECV, LOSS_SEND, RUN, SUM, SUMMED, Op)

#: What the finalize's token-count all-reduce is called in a ``coll`` op.
TOKEN_COUNT = "token-count"


def chunks_with_real_forward(acts: Sequence[Action], is_fake: Callable) -> List[int]:
    """The chunks (model indices) of a rank with a real forward, in the order of their first real
    forward: the ones whose parameter all-gathers are started, in that order. DualPipe's second
    half of the ranks, and DualPipeV nowhere, run chunk 1 first."""
    order: List[int] = []
    for a in acts:
        if a.op == F and not is_fake(a) and a.dir not in order:
            order.append(a.dir)
    return order


def rank_program(ops: Sequence[Op], layout: Layout, r: int, actions: Sequence[Action],
                 units: Sequence[Tuple[int, ...]], is_fake: Callable, *, sum_points: Sequence[Tuple[int, int]],
                 dp_points: Sequence[Tuple[int, int]], param_gather: bool, forward_only: bool,
                 wait_at_issue: bool = False) -> Tuple[Op, ...]:
    """Rank ``r``'s lowered ``ops`` (ending with ``finish``) with the collectives around the
    schedule (module docstring). ``param_gather``: the chunks' all-gathers are started before the
    first action; ``sum_points`` / ``dp_points``: the plan's points, index ``len(actions)`` at the
    end of the schedule."""
    end, sum_at = len(actions), {c: i for i, c in sum_points}
    # a reduction planned after its chunk's sum, in the schedule, waits for the sum first
    early = set() if wait_at_issue else {c for i, c in dp_points if sum_at.get(c, end) <= i < end}
    after: Dict[int, List[Op]] = {}
    for i, c in sum_points:
        after.setdefault(i, []).extend([Op(SUM, c), Op(SUMMED, c)] if wait_at_issue else [Op(SUM, c)])
    if not wait_at_issue:
        after.setdefault(end, []).extend(Op(SUMMED, c) for _, c in sum_points if c not in early)
    for i, c in dp_points:
        after.setdefault(i, []).extend([Op(SUMMED, c), Op(DP, c)] if c in early else [Op(DP, c)])
    gathers = chunks_with_real_forward(actions, is_fake) if param_gather else []
    unit_of = {i: u for u, unit in enumerate(units) for i in unit}
    waits: Dict[int, List[Op]] = {}
    for c in gathers:
        first = next(i for i, a in enumerate(actions) if a.op == F and a.dir == c and not is_fake(a))
        waits.setdefault(unit_of[first], []).append(Op(GATHERED, c))
    out: List[Op] = [Op(GATHER, c) for c in gathers]
    for op in ops:
        if op.kind == RUN:
            out += waits.get(op.index, ())
            out.append(op)
            for i in units[op.index]:
                out += after.get(i, ())
        else:
            out.append(op)
    out += after.get(end, ())
    return tuple(out + loss_gather(layout, r) + ([] if forward_only else finalize(layout)))


def loss_gather(layout: Layout, r: int) -> List[Op]:
    """Rank ``r``'s part of the loss gather: each direction whose last stage ends the model and
    is not on rank pp-1 ships its loss entries there, in direction order."""
    last, out = layout.pp - 1, []
    for d in layout.directions:
        final = layout.stages(d)[-1]
        owner = layout.rank_of(d, final)
        if not layout.is_last(d, final) or owner == last:
            continue
        if r == owner:
            out.append(Op(LOSS_SEND, d, peer=last))
        elif r == last:
            out.append(Op(LOSS_RECV, d, peer=owner))
    return out


def finalize(layout: Layout) -> List[Op]:
    """The finalize's ops: for two chunks the token-count all-reduce over the pipeline
    (``mcore.finalize``, issued with per-token loss), then Megatron's finalize."""
    tokens = [Op(COLL, what=TOKEN_COUNT, group="pp")] if len(layout.directions) == 2 else []
    return tokens + [Op(FINALIZE)]

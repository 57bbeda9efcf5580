"""One iteration's program: per rank the actions, the communication plan, the padding and the op
list that the runner executes, the simulator times and the iteration plan checks. One function builds
it, once per (schedule, pp, micro-batches, real, forward_only, options), by passes in order: generate ->
forward-only -> pad -> p2p -> lower -> reductions -> gathers, loss and finalize -> step collectives.
Standard library only.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

from .. import step_collectives
from ..actions import F, W, Action
from ..comm import RankPlan
from ..layout import Layout
from ..padding import Padded
from ..registry import Schedule, build_schedule
from .collectives import finalize, loss_gather, place_gathers
from .ops import Op
from .p2p import lower_ranks
from .reductions import Point, bd_sum_points, dp_start_points, final_points, grad_ops, place_reductions


@dataclass(frozen=True)
class ProgramOptions:
    """What the run adds around the schedule. ``zero_bubble``: a chunk is final at its W;
    ``overlap_grad_reduce`` and ``dp``: the ``dp`` ops start collectives; ``param_gather``:
    ``config.param_sync_func`` is set; ``bd_sums``: the copies are summed during the schedule;
    ``sums_at_end``: every bd sum after it (``iteration_plan.plan_for``); ``step``: the collectives
    after the schedule (``step_collectives``; None: none)."""

    zero_bubble: bool = True
    overlap_grad_reduce: bool = False
    dp: int = 1
    param_gather: bool = False
    bd_sums: bool = True
    sums_at_end: bool = False
    step: Optional[step_collectives.StepOptions] = None


@dataclass(frozen=True)
class Program:
    """The built program. ``padding[rank][i]``: action ``i`` of ``rank`` is a fake's; ``ops``: the
    schedule's ops up to ``finish``, then the collectives after it; ``step_ops``: the ``coll`` ops
    after the finalize; ``sum_points`` / ``dp_points``: the reductions pass's points per rank."""

    schedule: Schedule
    forward_only: bool
    options: ProgramOptions
    actions: Tuple[Tuple[Action, ...], ...]
    plans: Tuple[RankPlan, ...]
    padded: Padded
    padding: Tuple[Tuple[bool, ...], ...]
    ops: Tuple[Tuple[Op, ...], ...] = ()
    step_ops: Tuple[Tuple[Op, ...], ...] = ()
    sum_points: Tuple[Tuple[Point, ...], ...] = ()
    dp_points: Tuple[Tuple[Point, ...], ...] = ()

    @property
    def layout(self) -> Layout:
        return self.schedule.layout

    @property
    def deferring(self) -> bool:
        """Whether a chunk's gradients are final at its W (zero bubble with deferred weight gradients)."""
        return self.options.zero_bubble and self.schedule.spec.defers_weight_grads and \
            any(a.op == W for acts in self.actions for a in acts)


@functools.lru_cache(maxsize=64)
def build_program(name: str, pp: int, microbatches: int, real: Optional[int] = None, forward_only: bool = False,
                  options: ProgramOptions = ProgramOptions()) -> Program:
    """The program of schedule ``name`` for ``microbatches`` micro-batches of which ``real``
    (default all) are real, the rest padding; cached: pure and reused every iteration."""
    base = _lowered(name, pp, microbatches, microbatches if real is None else real, forward_only)
    program = dataclasses.replace(base, options=options)
    sums, dps, finals = reduction_points(program)
    ops = []
    for r in range(pp):  # the reductions, then the gathers, loss and finalize pass
        rank_ops = place_reductions(base.ops[r], base.actions[r], base.plans[r].units, sums[r], dps[r], finals[r])
        if options.param_gather and not forward_only:
            rank_ops = place_gathers(rank_ops, base.actions[r], base.plans[r].units, base.padded.is_fake)
        ops.append(rank_ops + tuple(loss_gather(base.layout, r) + ([] if forward_only else finalize(base.layout))))
    step = step_collectives.programs(program.layout, options.step, dp=options.dp, forward_only=forward_only,
                                     overlap_grad_reduce=options.overlap_grad_reduce) \
        if options.step is not None else [()] * pp
    return dataclasses.replace(program, ops=tuple(ops), step_ops=tuple(tuple(x) for x in step), sum_points=sums,
                               dp_points=dps)


@functools.lru_cache(maxsize=64)
def _lowered(name: str, pp: int, microbatches: int, real: int, forward_only: bool) -> Program:
    """The passes that do not depend on the options: generate, forward-only, pad, p2p, lower."""
    sched = build_schedule(name, pp, microbatches)
    # forward only: just the forwards, in the same order, none fused with a backward
    acts = tuple(tuple(dataclasses.replace(a, overlap=False) for a in r if a.op == F) for r in sched.ranks) \
        if forward_only else sched.ranks
    padded = Padded(sched, real)
    padding = tuple(padded.padding(r) for r in acts)
    plans, ops = lower_ranks(sched.layout, acts, padding)
    return Program(sched, forward_only, ProgramOptions(), acts, plans, padded, padding, ops)


def reduction_points(program: Program) -> Tuple[tuple, tuple, tuple]:
    """Per rank, the bd-sum points, the data-parallel start points and where each chunk's gradient
    actions are done (``reductions``)."""
    layout, acts, opts, is_fake = program.layout, program.actions, program.options, program.padded.is_fake
    if program.forward_only:
        return ((),) * layout.pp, ((),) * layout.pp, ((),) * layout.pp
    ops = grad_ops(program.deferring)
    bd = layout.mirrored and opts.bd_sums
    sums = tuple(tuple(bd_sum_points(acts[r], acts[layout.partner(r)], is_fake, ops, lower_rank=r < layout.partner(r),
                                     at_end=opts.sums_at_end)) if bd and layout.partner(r) != r else ()
                 for r in range(layout.pp))
    dps = tuple(tuple(dp_start_points(layout, r, acts[r], is_fake, ops, bd_sums=opts.bd_sums))
                for r in range(layout.pp))
    return sums, dps, tuple(final_points(acts[r], is_fake, ops, len(layout.directions)) for r in range(layout.pp))


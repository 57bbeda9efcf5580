"""When each chunk's gradients are final on a rank, and in which order a bd pair sums them.

DualPipe's two copies of a stage (chunk c on rank r, chunk 1-c on rank pp-1-r) are summed over
the pair as soon as both are final, while the rest of the schedule runs. What "final" means and
the order in which both partners issue their sums follow from the action lists alone, so they
live here, beside the schedule: the Megatron gradient reduction (``mcore.grads``) and the
benchmark's synthetic gradients (``bench.bd_sum``) both use them. Standard library only.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

#: The ops that finish a chunk's weight gradients: with deferred weight gradients (zero bubble)
#: a B leaves them to its W.
DEFERRED_GRAD_OPS = ("BW", "W")
FULL_GRAD_OPS = ("B", "BW")


def grad_ops(deferring: bool) -> Tuple[str, str]:
    return DEFERRED_GRAD_OPS if deferring else FULL_GRAD_OPS


def last_grad_actions(actions: Sequence, is_fake: Callable, ops: Sequence[str]) -> Dict[int, tuple]:
    """{chunk: (op, mb, stage)} of the last real gradient action of each chunk (direction)."""
    last = {}
    for a in actions:
        if a.op in ops and not is_fake(a):
            last[a.dir] = (a.op, a.mb, a.stage)
    return last


def completion_order(actions: Sequence, is_fake: Callable, ops: Sequence[str]) -> List[int]:
    """The chunks of a rank in the order their last real gradient action runs."""
    last = {}
    for k, a in enumerate(actions):
        if a.op in ops and not is_fake(a):
            last[a.dir] = k
    return sorted(last, key=last.get) + [c for c in (0, 1) if c not in last]


def bd_sum_order(actions: Sequence, partner_actions: Sequence, is_fake: Callable, ops: Sequence[str],
                 lower_rank: bool) -> List[int]:
    """This rank's chunks in the order both partners issue the sums (the partner's chunk 1-c is
    this rank's chunk c): the order in which the chunks finish when it is the same on both
    (DualPipe's symmetry), else the lower rank's, so that the pair's collectives match."""
    mine = completion_order(actions, is_fake, ops)
    theirs = [1 - c for c in completion_order(partner_actions, is_fake, ops)]
    return mine if mine == theirs or lower_rank else theirs

"""The one dependency rule, what an action waits for: the simulator, the validator and the communication
planner (whose plan is all the executor reads) use it, so they never disagree about when an action is ready.
A dependency on another stage hands a tensor over (:func:`hands_over`); one on its own stage is state it keeps.
"""
from __future__ import annotations

from typing import List, Tuple

from .actions import B, BW, F, W, Action
from .layout import Layout

#: A completion event: ("F" | "B" | "W", dir, mb, stage). B and BW both complete "B".
Event = Tuple[str, int, int, int]


def event_of(a: Action) -> Event:
    """The event an action completes."""
    kind = "B" if a.op in (B, BW) else a.op
    return (kind, a.dir, a.mb, a.stage)


def waits_for(layout: Layout, a: Action) -> List[Event]:
    """Events ``a`` needs before it can start: an F the previous stage's F on the micro-batch's route; a
    backward its own F and the next stage's backward; a W its own B."""
    if a.op == F:
        prev = layout.prev_hop(a.dir, a.stage)
        return [] if prev is None else [(F, prev[0], a.mb, prev[1])]
    if a.op in (B, BW):
        deps: List[Event] = [(F, a.dir, a.mb, a.stage)]
        nxt = layout.next_hop(a.dir, a.stage)
        if nxt is not None:
            deps.append(("B", nxt[0], a.mb, nxt[1]))
        return deps
    if a.op == W:
        return [("B", a.dir, a.mb, a.stage)]
    raise ValueError(f"unknown op {a.op!r}")


def hands_over(a: Action, e: Event) -> bool:
    """Whether ``e``, an event ``a`` waits for, hands ``a`` a tensor (it is another stage's)."""
    return (e[1], e[3]) != (a.dir, a.stage)


def event_rank(layout: Layout, e: Event) -> int:
    return layout.rank_of(e[1], e[3])

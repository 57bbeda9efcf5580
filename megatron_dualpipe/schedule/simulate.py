"""A discrete-event simulator over per-rank action lists.

Each rank runs its list in order, one action (or one fused F&B unit) at a time. An action
starts when the rank is free and every event it waits for (``deps.waits_for``) has finished,
plus ``p2p`` when that event happened on another rank. An F marked ``overlap`` and the
backward right after it form one unit costing ``fb``; both actions get the unit's start and
end. A set of lists that cannot complete raises :class:`DeadlockError` naming the stuck ranks
and what each waits for.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .actions import B, BW, F, W, Action, format_grid, units
from .deps import Event, event_of, event_rank, waits_for
from .layout import Layout


class DeadlockError(RuntimeError):
    pass


@dataclass(frozen=True)
class Costs:
    """Cost model. ``b`` is a full backward (input + weight gradients); an input-only B costs
    ``b - w``; a fused F&B unit costs ``fb`` (default ``f + b``, i.e. no overlap gain)."""

    f: float = 1.0
    b: float = 2.0
    w: float = 1.0
    fb: Optional[float] = None
    p2p: float = 0.0

    def __post_init__(self):
        for name in ("f", "b", "w", "fb", "p2p"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"cost --{name} must be a finite number, got {v}")
        for name in ("f", "b", "w", "p2p"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost --{name} must be >= 0, got {getattr(self, name)}")
        if self.w > self.b:
            raise ValueError(f"--w ({self.w}) cannot exceed --b ({self.b}): b is the full backward, w a part of it")
        if self.fb is not None and self.fb < 0:
            raise ValueError(f"cost --fb must be >= 0, got {self.fb}")

    @property
    def fused(self) -> float:
        return self.f + self.b if self.fb is None else self.fb

    def of(self, a: Action) -> float:
        return {F: self.f, BW: self.b, B: self.b - self.w, W: self.w}[a.op]

    def unit(self, acts: Sequence[Action]) -> float:
        """The cost of one execution unit: one action, or a fused F&B pair (``fused``)."""
        return self.fused if len(acts) == 2 else self.of(acts[0])

    def holds_memory(self, a: Action) -> bool:
        """Whether ``a`` keeps activations (or weight-gradient state) alive: every real action."""
        return True

    def scaled(self, k: float) -> "Costs":
        """The compute costs times ``k`` (a model piece ``k`` times as large); ``p2p`` unchanged."""
        return Costs(self.f * k, self.b * k, self.w * k, None if self.fb is None else self.fb * k, self.p2p)


@dataclass(frozen=True)
class PaddedCosts(Costs):
    """Costs of a padded schedule: fake micro-batches (``is_fake(action)``) compute nothing, as
    in the executor, so they cost 0 (their sends still pay ``p2p``)."""

    is_fake: Callable[[Action], bool] = lambda a: False

    @staticmethod
    def wrap(costs: Costs, is_fake: Callable[[Action], bool]) -> "PaddedCosts":
        return PaddedCosts(costs.f, costs.b, costs.w, costs.fb, costs.p2p, is_fake)

    def holds_memory(self, a: Action) -> bool:
        return not self.is_fake(a)

    def unit(self, acts: Sequence[Action]) -> float:
        real = [a for a in acts if not self.is_fake(a)]
        return super().unit(acts) if len(real) == len(acts) else sum(self.of(a) for a in real)


@dataclass
class RankTimeline:
    starts: List[float] = field(default_factory=list)
    ends: List[float] = field(default_factory=list)
    busy: float = 0.0
    peak_activations: int = 0
    peak_weight_grad_states: int = 0


@dataclass
class SimResult:
    makespan: float
    ranks: List[RankTimeline]

    @property
    def busy(self) -> List[float]:
        return [r.busy for r in self.ranks]

    @property
    def bubble(self) -> List[float]:
        return [self.makespan - r.busy for r in self.ranks]

    @property
    def peak_activations(self) -> List[int]:
        return [r.peak_activations for r in self.ranks]

    def to_json(self) -> dict:
        return {"makespan": self.makespan, "bubble": self.bubble, "peak_activations": self.peak_activations,
                "busy": self.busy}


def _count_memory(timeline: RankTimeline, a: Action, live: List[int], wstate: List[int], r: int) -> None:
    """Rank r's saved activations (a forward saves one, its backward frees it) and weight-gradient
    states (a B without its W keeps one until the W), with their peaks."""
    if a.op == F:
        live[r] += 1
    elif a.is_backward:
        live[r] -= 1
        if a.op == B:
            wstate[r] += 1
    elif a.op == W:
        wstate[r] -= 1
    timeline.peak_activations = max(timeline.peak_activations, live[r])
    timeline.peak_weight_grad_states = max(timeline.peak_weight_grad_states, wstate[r])


def simulate(layout: Layout, ranks: Sequence[Sequence[Action]], costs: Costs = Costs(),
             progress: Optional[Callable[[int, int], None]] = None,
             p2p: Optional[Callable[[int, int], float]] = None, overhead: float = 0.0) -> SimResult:
    """Time every rank's list; ``progress(done, total)`` is called every few thousand units.

    ``p2p(src, dst)``: what a message from rank src to rank dst adds (``comm_cost.CommModel.p2p``:
    latency and bytes over the link between them); default ``costs.p2p`` for every pair.
    ``overhead``: what running one unit costs beyond its compute (a measured executor's own cost).

    Event-driven: a rank's next unit enters a heap keyed by (start time, rank) as soon as
    every event it waits for has finished (its start is then fixed), and a finished event
    wakes only the ranks waiting for it. Popping the heap runs the ready unit that starts
    earliest, lowest rank first on ties: O(units log pp), the same order a full scan of the
    ranks at every step would pick.
    """
    pp = len(ranks)
    hop = p2p or (lambda src, dst: costs.p2p)
    plans = [units(acts) for acts in ranks]
    pos = [0] * pp
    free_at = [0.0] * pp
    done: Dict[Event, Tuple[float, int]] = {}
    timelines = [RankTimeline(starts=[0.0] * len(a), ends=[0.0] * len(a)) for a in ranks]
    live = [0] * pp
    wstate = [0] * pp
    ready: List[Tuple[float, int]] = []
    waiting: Dict[Event, List[int]] = {}

    def examine(r: int) -> None:
        """Queue rank r's next unit if it can start, else wait for the first missing event."""
        if pos[r] >= len(plans[r]):
            return
        unit = plans[r][pos[r]]
        start = free_at[r]
        for i in unit:
            for e in waits_for(layout, ranks[r][i]):
                if e in done:
                    t, er = done[e]
                    start = max(start, t + (hop(er, r) if er != r else 0.0))
                elif not any(event_of(ranks[r][j]) == e for j in unit if j < i):
                    waiting.setdefault(e, []).append(r)
                    return
        heapq.heappush(ready, (start, r))

    for r in range(pp):
        examine(r)
    total = sum(len(p) for p in plans)
    remaining = total
    while remaining:
        if not ready:
            raise DeadlockError(_deadlock_message(layout, ranks, plans, pos, done))
        start, r = heapq.heappop(ready)
        unit = plans[r][pos[r]]
        cost = costs.unit([ranks[r][i] for i in unit]) + overhead
        end = start + cost
        woken: List[int] = []
        for i in unit:
            a = ranks[r][i]
            timelines[r].starts[i], timelines[r].ends[i] = start, end
            e = event_of(a)
            done[e] = (end, r)
            woken.extend(waiting.pop(e, ()))
            if costs.holds_memory(a):
                _count_memory(timelines[r], a, live, wstate, r)
        timelines[r].busy += cost
        free_at[r] = end
        pos[r] += 1
        remaining -= 1
        examine(r)
        for w in woken:
            if w != r:
                examine(w)
        if progress is not None and remaining % 4096 == 0:
            progress(total - remaining, total)
    return SimResult(max(free_at, default=0.0), timelines)


def _deadlock_message(layout, ranks, plans, pos, done) -> str:
    lines = ["schedule cannot complete:"]
    mark = None
    for r in range(len(ranks)):
        if pos[r] >= len(plans[r]):
            continue
        i = plans[r][pos[r]][0]
        missing = [e for j in plans[r][pos[r]] for e in waits_for(layout, ranks[r][j]) if e not in done]
        what = ", ".join(f"{e[0]}{e[1]}.{e[2]} (stage {e[3]}, rank {event_rank(layout, e)})" for e in missing)
        lines.append(f"  rank {r} action {i} {ranks[r][i]} waits for {what}")
        mark = mark or (r, i)
    lines.append(format_grid(ranks, mark))
    return "\n".join(lines)

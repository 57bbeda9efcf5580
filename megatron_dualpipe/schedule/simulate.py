"""A discrete-event simulator over per-rank action lists.

Each rank runs its list in order, one action (or one fused F&B unit) at a time. An action
starts when the rank is free and every event it waits for (``deps.waits_for``) has finished,
plus ``p2p`` when that event happened on another rank. An F marked ``overlap`` and the
backward right after it form one unit costing ``fb``; both actions get the unit's start and
end. A set of lists that cannot complete raises :class:`DeadlockError` naming the stuck ranks
and what each waits for.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

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


def simulate(layout: Layout, ranks: Sequence[Sequence[Action]], costs: Costs = Costs()) -> SimResult:
    pp = len(ranks)
    plans = [units(acts) for acts in ranks]
    pos = [0] * pp
    free_at = [0.0] * pp
    done: Dict[Event, Tuple[float, int]] = {}
    timelines = [RankTimeline(starts=[0.0] * len(a), ends=[0.0] * len(a)) for a in ranks]
    live = [0] * pp
    wstate = [0] * pp

    remaining = sum(len(p) for p in plans)
    while remaining:
        # Among ranks whose next unit is ready, run the one that can start earliest. A unit's
        # readiness depends only on finished events, so this order is a valid event order.
        best = None
        for r in range(pp):
            if pos[r] >= len(plans[r]):
                continue
            unit = plans[r][pos[r]]
            start = free_at[r]
            ready = True
            for i in unit:
                for e in waits_for(layout, ranks[r][i]):
                    if e in done:
                        t, er = done[e]
                        start = max(start, t + (costs.p2p if er != r else 0.0))
                    elif not any(event_of(ranks[r][j]) == e for j in unit if j < i):
                        ready = False
                        break
                if not ready:
                    break
            if ready and (best is None or start < best[0]):
                best = (start, r, unit)
        if best is None:
            raise DeadlockError(_deadlock_message(layout, ranks, plans, pos, done))
        start, r, unit = best
        cost = costs.fused if len(unit) == 2 else costs.of(ranks[r][unit[0]])
        end = start + cost
        for i in unit:
            a = ranks[r][i]
            timelines[r].starts[i], timelines[r].ends[i] = start, end
            done[event_of(a)] = (end, r)
            if a.op == F:
                live[r] += 1
            elif a.is_backward:
                live[r] -= 1
                if a.op == B:
                    wstate[r] += 1
            elif a.op == W:
                wstate[r] -= 1
            timelines[r].peak_activations = max(timelines[r].peak_activations, live[r])
            timelines[r].peak_weight_grad_states = max(timelines[r].peak_weight_grad_states, wstate[r])
        timelines[r].busy += cost
        free_at[r] = end
        pos[r] += 1
        remaining -= 1
    return SimResult(max(free_at), timelines)


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

"""A discrete-event simulator over each rank's lowered program: the ops the runner executes.

Why: a model of the runner could disagree with what runs; here each rank walks the same ops.
``run U`` occupies the rank for the unit's cost (a fused F&B unit costs ``fb``); ``post K`` posts
batch K's sends at the rank's clock; ``recv L <- P`` completes no earlier than P's post of L plus
``p2p``; ``release L -> P`` no earlier than P's receive of L; collectives cost nothing yet. A
program that cannot complete raises :class:`DeadlockError` naming what each stuck rank waits for.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from .actions import B, BW, F, W, Action, format_grid, units
from .comm import CommPlanError, RankPlan
from .deps import Event, event_of, event_rank, waits_for
from .layout import Layout
from .lowering.ops import Op, OpKind
from .lowering.p2p import lower_ranks

POST, RECV, RELEASE, RUN = OpKind.POST, OpKind.RECV, OpKind.RELEASE, OpKind.RUN


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
        values = [(name, getattr(self, name)) for name in ("f", "b", "w", "fb", "p2p")]
        for name, v in values:
            if v is not None and not math.isfinite(v):
                raise ValueError(f"cost --{name} must be a finite number, got {v}")
        for name, v in values:
            if v is not None and v < 0:
                raise ValueError(f"cost --{name} must be >= 0, got {v}")
        if self.w > self.b:
            raise ValueError(f"--w ({self.w}) cannot exceed --b ({self.b}): b is the full backward, w a part of it")

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
    """Costs of a padded schedule: fake micro-batches compute nothing, as in the executor (their
    sends still pay ``p2p``)."""

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


@functools.lru_cache(maxsize=16)
def misordered(layout: Layout, ranks: Tuple[Tuple[Action, ...], ...]) -> Tuple[int, ...]:
    """Per rank, the first unit waiting for an event of its own rank that comes later or never (a
    deferred W without its B, a backward before its forward): it can never start. ``len(units)``
    where there is none. The waits between ranks are the program's ``recv`` ops."""
    where = {event_of(a): (r, i) for r, acts in enumerate(ranks) for i, a in enumerate(acts)}
    out = []
    for r, acts in enumerate(ranks):
        us = units(acts)
        out.append(len(us))
        for k, unit in enumerate(us):
            if any((at := where.get(e)) is None or (at[0] == r and at[1] > i)
                   for i in unit for e in waits_for(layout, acts[i])):
                out[-1] = k
                break
    return tuple(out)


def simulate(layout: Layout, ranks: Sequence[Sequence[Action]], costs: Costs = Costs(),
             progress: Optional[Callable[[int, int], None]] = None,
             p2p: Optional[Callable[[int, int], float]] = None, overhead: float = 0.0) -> SimResult:
    """Time every rank's lowered program; ``progress(done, total)`` is called every few thousand
    units. ``p2p(src, dst)``: a message's cost (``comm_cost.CommModel.p2p``; default ``costs.p2p``);
    ``overhead``: a unit's cost beyond its compute. A schedule the planner refuses raises
    :class:`DeadlockError` too."""
    frozen = tuple(tuple(acts) for acts in ranks)
    fake = getattr(costs, "is_fake", None)
    padding = tuple(tuple(bool(fake and fake(a)) for a in acts) for acts in frozen)
    try:
        plans, ops = lower_ranks(layout, frozen, padding)
    except CommPlanError as e:
        raise DeadlockError(_unplannable(layout, frozen, e)) from e
    return _walk_ops(layout, frozen, plans, ops, costs, progress=progress, p2p=p2p, overhead=overhead)


def simulate_program(program, costs: Costs = Costs(), progress: Optional[Callable[[int, int], None]] = None,
                     p2p: Optional[Callable[[int, int], float]] = None, overhead: float = 0.0) -> SimResult:
    """Time a built ``Program``'s ops in order (untyped: that module imports this one). Arguments
    as :func:`simulate`."""
    return _walk_ops(program.layout, program.actions, program.plans, program.ops, costs, progress=progress, p2p=p2p,
                     overhead=overhead)


def _walk_ops(layout: Layout, ranks: Sequence[Sequence[Action]], plans: Sequence[RankPlan],
              ops: Sequence[Sequence[Op]], costs: Costs, progress: Optional[Callable[[int, int], None]],
              p2p: Optional[Callable[[int, int], float]], overhead: float) -> SimResult:
    """Time ``ops`` walked in order (``plans`` give each ``post``'s sends): a rank walks until a
    wait cannot complete yet and a post wakes the rank waiting for it, so every op is visited once."""
    never = misordered(layout, tuple(tuple(acts) for acts in ranks))
    walk = _Walk(ranks, plans, ops, never, costs, p2p or (lambda src, dst: costs.p2p), overhead, progress)
    todo = list(range(len(ranks)))
    while todo:
        todo.extend(walk.advance(todo.pop()))
    stuck = {r: plans[r].units[ops[r][walk.pc[r]].index] for r in range(len(ranks)) if walk.pc[r] < len(ops[r])}
    if stuck:
        done = {event_of(ranks[r][i]) for r, p in enumerate(plans) for u in p.units[:walk.ran[r]] for i in u}
        raise DeadlockError(_deadlock_message(layout, ranks, stuck, done))
    return SimResult(max(walk.free_at, default=0.0), walk.timelines)


class _Walk:
    """:func:`_walk_ops`' state: each rank's position and clock, the sends and receives with their
    times, and who waits for which."""

    def __init__(self, ranks, plans, ops, never, costs, hop, overhead, progress):
        self.ranks, self.plans, self.ops, self.never = ranks, plans, ops, never
        self.costs, self.hop, self.overhead, self.progress = costs, hop, overhead, progress
        pp = len(ranks)
        self.pc, self.clock, self.free_at = [0] * pp, [0.0] * pp, [0.0] * pp
        self.live, self.wstate = [0] * pp, [0] * pp
        self.timelines = [RankTimeline(starts=[0.0] * len(a), ends=[0.0] * len(a)) for a in ranks]
        self.posted: Dict[tuple, float] = {}    # (src, dst, label) -> when the send was posted
        self.received: Dict[tuple, float] = {}  # (src, dst, label) -> when the receiver has it
        self.wait_send: Dict[tuple, int] = {}   # (src, dst, label) -> the rank waiting for that post
        self.wait_recv: Dict[tuple, int] = {}   # (src, dst, label) -> the rank waiting for that receive
        self.ran = [0] * pp  # units run per rank
        self.total = sum(len(p.units) for p in plans)

    def advance(self, r: int) -> List[int]:
        """Walk rank ``r`` until it waits or ends; return the ranks its posts and receives woke."""
        ops, batches, woken = self.ops[r], self.plans[r].batches, []
        posted, received, wait_send, wait_recv = self.posted, self.received, self.wait_send, self.wait_recv
        pc, n = self.pc[r], len(ops)
        while pc < n:
            op = ops[pc]
            kind = op.kind
            if kind == RUN:
                if op.index == self.never[r]:
                    break
                self.run(r, self.plans[r].units[op.index])
            elif kind == POST:
                for t in batches[op.index].sends:
                    key = (r, t.peer, t.label)
                    posted[key] = self.clock[r]
                    if key in wait_send:
                        woken.append(wait_send.pop(key))
            elif kind == RECV:
                key = (op.peer, r, op.label)
                if key not in posted:
                    wait_send[key] = r
                    break
                self.clock[r] = received[key] = max(self.clock[r], posted[key] + self.hop(op.peer, r))
                if key in wait_recv:
                    woken.append(wait_recv.pop(key))
            elif kind == RELEASE:  # the forward's output must have been received before it is freed
                key = (r, op.peer, op.label)
                if key not in received:
                    wait_recv[key] = r
                    break
                self.clock[r] = max(self.clock[r], received[key])
            # begin, finish and the collectives (sum, dp, gather, loss, coll, finalize, ...) cost nothing yet
            pc += 1
        self.pc[r] = pc
        return woken

    def run(self, r: int, unit: Tuple[int, ...]) -> None:
        """Run ``unit`` at rank ``r``'s clock."""
        acts = self.ranks[r]
        cost = self.costs.unit([acts[i] for i in unit]) + self.overhead
        start = self.clock[r]
        end = start + cost
        timeline = self.timelines[r]
        for i in unit:
            a = acts[i]
            timeline.starts[i], timeline.ends[i] = start, end
            if self.costs.holds_memory(a):
                _count_memory(timeline, a, self.live, self.wstate, r)
        timeline.busy += cost
        self.clock[r] = self.free_at[r] = end
        self.ran[r] += 1
        if self.progress is not None and (self.total - sum(self.ran)) % 4096 == 0:
            self.progress(sum(self.ran), self.total)


def _ready(layout: Layout, acts: Sequence[Action], unit: Tuple[int, ...], done: Set[Event]) -> bool:
    """Whether every event ``unit``'s actions wait for has happened (or happens earlier in the unit)."""
    return all(e in done or any(event_of(acts[j]) == e for j in unit[:n])
               for n, i in enumerate(unit) for e in waits_for(layout, acts[i]))


def _unplannable(layout: Layout, ranks: Sequence[Sequence[Action]], err: CommPlanError) -> str:
    """Why ``ranks`` cannot be planned: the actions stuck when every rank runs what it can, or the
    planner's own reason where each could run (a message order the executor cannot match)."""
    plans = [units(acts) for acts in ranks]
    pos, done, moved = [0] * len(ranks), set(), True
    while moved:
        moved = False
        for r, us in enumerate(plans):
            while pos[r] < len(us) and _ready(layout, ranks[r], us[pos[r]], done):
                done.update(event_of(ranks[r][i]) for i in us[pos[r]])
                pos[r], moved = pos[r] + 1, True
    stuck = {r: us[pos[r]] for r, us in enumerate(plans) if pos[r] < len(us)}
    if not stuck:
        return f"schedule cannot complete: {err}"
    return _deadlock_message(layout, ranks, stuck, done)


def _deadlock_message(layout, ranks, stuck: Dict[int, Tuple[int, ...]], done: Set[Event]) -> str:
    """The stuck ranks (``stuck``: rank -> the unit it cannot start), what each waits for, and the grid."""
    lines = ["schedule cannot complete:"]
    mark = None
    for r, unit in sorted(stuck.items()):
        i = unit[0]
        missing = [e for j in unit for e in waits_for(layout, ranks[r][j]) if e not in done]
        what = ", ".join(f"{e[0]}{e[1]}.{e[2]} (stage {e[3]}, rank {event_rank(layout, e)})" for e in missing)
        lines.append(f"  rank {r} action {i} {ranks[r][i]} waits for {what}")
        mark = mark or (r, i)
    lines.append(format_grid(ranks, mark))
    return "\n".join(lines)

"""The communication pass: which tensors each rank sends and receives around each action.

Compute-only schedules come from ``generators``; this pass adds the point-to-point traffic
that the executor carries out, and checks it before anything runs:

* Before each execution unit (one action, or an overlapped F with its backward) a rank posts
  ONE batch: the sends produced by its previous unit, and the receives its unit needs. The
  executor turns each batch into one ``batch_isend_irecv``, as DeepSeek's reference does.
* Where that would deadlock (two ranks each sending to the other before either receives), the
  planner moves the receive earlier, into the batch the receiving rank is blocked in: that is
  the prefetching DeepSeek's reference does by hand (``_recv_forward`` ahead of its use).
* Between two ranks, messages in one direction are matched in posting order (NCCL matches
  point-to-point operations in order; tensors of one shape cannot be told apart). The
  checker proves that, for every ordered pair of ranks, the sender's order equals the
  receiver's order, and that the batches complete under the strictest semantics (a batch
  finishes only when all its operations have been matched), so the plan cannot deadlock on
  NCCL or gloo.

A transfer's label says what it carries: ``("act" | "grad", dir, mb, stage)``, where ``stage``
is the stage that consumes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from .actions import F, Action, units
from .deps import Event, event_of, event_rank, hands_over, waits_for
from .layout import Layout

#: What a transfer carries: ("act" | "grad", dir, mb, stage of the action that consumes it).
Label = Tuple[str, int, int, int]
#: One end of a hand-over: (the other rank, the label). The other rank may be this rank
#: (DualPipeV's turn at rank pp-1), where the executor hands the tensor over without P2P.
Hand = Tuple[int, Label]


@dataclass(frozen=True)
class Transfer:
    peer: int
    label: Label


@dataclass
class Batch:
    """Operations posted together before unit ``unit`` (``unit == len(units)``: the final flush)."""

    unit: int
    sends: List[Transfer] = field(default_factory=list)
    recvs: List[Transfer] = field(default_factory=list)


@dataclass
class RankPlan:
    """One rank's plan. ``inputs[i]`` / ``outputs[i]``: the tensors action ``i`` takes and hands
    on, with the rank at the other end; the executor reads only these and the batches."""

    units: List[Tuple[int, ...]]
    batches: List[Batch]
    inputs: List[Tuple[Hand, ...]] = field(default_factory=list)
    outputs: List[Tuple[Hand, ...]] = field(default_factory=list)


class CommPlanError(RuntimeError):
    pass


def label_of(a: Action) -> Label:
    """The label of the tensor ``a`` receives: an activation for an F, a gradient otherwise."""
    return ("act" if a.op == F else "grad", a.dir, a.mb, a.stage)


def describe(label: Label) -> str:
    """A label in words, for error messages."""
    kind, d, mb, stage = label
    what = "activation" if kind == "act" else "gradient"
    return f"{what} of micro-batch {mb} of direction {d} for stage {stage}"


def hand_overs(layout: Layout, ranks: Sequence[Sequence[Action]]) -> Tuple[List[List[Tuple[Hand, ...]]],
                                                                          List[List[Tuple[Hand, ...]]]]:
    """Per rank and action: the tensors it takes and hands on, from ``deps.waits_for`` (the one
    rule): every dependency on another stage's event is a tensor handed from the rank of that
    event to the rank of the action that waits."""
    where: Dict[Event, Tuple[int, int]] = {}
    for r, acts in enumerate(ranks):
        for i, a in enumerate(acts):
            where[event_of(a)] = (r, i)
    inputs: List[List[List[Hand]]] = [[[] for _ in acts] for acts in ranks]
    outputs: List[List[List[Hand]]] = [[[] for _ in acts] for acts in ranks]
    for r, acts in enumerate(ranks):
        for i, a in enumerate(acts):
            for e in waits_for(layout, a):
                if not hands_over(a, e):
                    continue
                if e not in where:
                    raise CommPlanError(f"rank {r} action {i} ({a}) waits for {e}, which no rank runs "
                                        f"(expected on rank {event_rank(layout, e)})")
                src, j = where[e]
                inputs[r][i].append((src, label_of(a)))
                outputs[src][j].append((r, label_of(a)))
    return ([[tuple(h) for h in per_rank] for per_rank in inputs],
            [[tuple(h) for h in per_rank] for per_rank in outputs])


def plan(layout: Layout, ranks: Sequence[Sequence[Action]]) -> List[RankPlan]:
    """Plan every rank and check the plan (raises :class:`CommPlanError`).

    A receive is posted no later than the unit that needs it, and the receives of one channel
    are posted in the order the peer sends them; where the peer sends a message earlier than
    this rank needs it, the receive is posted early (prefetched) to keep that order.
    """
    unit_lists = [units(acts) for acts in ranks]
    sends_after: List[List[List[Transfer]]] = []
    need_unit: List[Dict[Label, int]] = []
    channel_order: Dict[Tuple[int, int], List[Label]] = {}
    inputs, outputs = hand_overs(layout, ranks)
    for r, us in enumerate(unit_lists):
        sends_after.append([[Transfer(dst, label) for i in u for dst, label in outputs[r][i] if dst != r]
                            for u in us])
        need_unit.append({label: k for k, u in enumerate(us) for i in u for src, label in inputs[r][i] if src != r})
        for per_unit in sends_after[-1]:
            for t in per_unit:
                channel_order.setdefault((r, t.peer), []).append(t.label)

    post_unit: List[Dict[int, List[Transfer]]] = [dict() for _ in ranks]
    for (src, dst), labels in sorted(channel_order.items()):
        latest = len(unit_lists[dst])
        slots = []
        for label in reversed(labels):
            if label not in need_unit[dst]:
                raise CommPlanError(f"rank {src} sends {label} to rank {dst}, which never uses it")
            latest = min(latest, need_unit[dst][label])
            slots.append((latest, label))
        for k, label in reversed(slots):
            post_unit[dst].setdefault(k, []).append(Transfer(src, label))

    plans = []
    for r, us in enumerate(unit_lists):
        batches = []
        for k in range(len(us) + 1):
            sends = sends_after[r][k - 1] if k > 0 else []
            recvs = post_unit[r].get(k, [])
            if sends or recvs:
                batches.append(Batch(k, list(sends), list(recvs)))
        plans.append(RankPlan(us, batches, inputs[r], outputs[r]))
    _prefetch_where_needed(plans)
    check(plans)
    return plans


def _prefetch_where_needed(plans: List[RankPlan]) -> None:
    """Run the batches under strict semantics; when every rank is blocked, pull the receive
    that matches a blocked send into the receiver's current batch (with any earlier receives
    on the same channel, to keep the channel's order).

    Incremental: every transfer has its index on its channel, and a channel's state is how
    many of its sends and receives have been posted, so a step costs the size of one batch.
    """
    n = len(plans)
    index: Dict[Tuple[Tuple[int, int], Label], int] = {}
    counts: Dict[Tuple[int, int], int] = {}
    for r, p in enumerate(plans):
        for b in p.batches:
            for t in b.sends:
                ch = (r, t.peer)
                index[(ch, t.label)] = counts.get(ch, 0)
                counts[ch] = counts.get(ch, 0) + 1
    where: List[Dict[Tuple[Tuple[int, int], int], Batch]] = [dict() for _ in plans]
    for q, p in enumerate(plans):
        for b in p.batches:
            for t in b.recvs:
                ch = (t.peer, q)
                if (ch, t.label) not in index:
                    raise CommPlanError(f"rank {q} receives {t.label} from rank {t.peer}, which never sends it")
                where[q][(ch, index[(ch, t.label)])] = b
    sent: Dict[Tuple[int, int], int] = {}      # sends posted per channel (a prefix of its order)
    received: Dict[Tuple[int, int], int] = {}  # receives posted per channel
    at = [0] * n

    def post(r: int) -> None:
        if at[r] < len(plans[r].batches):
            b = plans[r].batches[at[r]]
            for t in b.sends:
                ch = (r, t.peer)
                sent[ch] = max(sent.get(ch, 0), index[(ch, t.label)] + 1)
            for t in b.recvs:
                ch = (t.peer, r)
                received[ch] = max(received.get(ch, 0), index[(ch, t.label)] + 1)

    def done(r: int) -> bool:
        b = plans[r].batches[at[r]]
        return all(received.get((r, t.peer), 0) > index[((r, t.peer), t.label)] for t in b.sends) and \
            all(sent.get((t.peer, r), 0) > index[((t.peer, r), t.label)] for t in b.recvs)

    for r in range(n):
        post(r)
    while True:
        progress = True
        while progress:
            progress = False
            for r in range(n):
                while at[r] < len(plans[r].batches) and done(r):
                    at[r] += 1
                    post(r)
                    progress = True
        if all(at[r] >= len(plans[r].batches) for r in range(n)):
            return
        pulled = False
        for r in range(n):
            if at[r] >= len(plans[r].batches):
                continue
            for t in plans[r].batches[at[r]].sends:
                q, ch = t.peer, (r, t.peer)
                i = index[(ch, t.label)]
                if received.get(ch, 0) > i or at[q] >= len(plans[q].batches):
                    continue
                target = plans[q].batches[at[q]]
                for j in range(received.get(ch, 0), i + 1):
                    b = where[q].pop((ch, j))
                    x = next(x for x in b.recvs if x.peer == r and index[(ch, x.label)] == j)
                    b.recvs.remove(x)
                    target.recvs.append(x)
                    where[q][(ch, j)] = target
                received[ch] = i + 1
                pulled = True
                break
            if pulled:
                break
        if not pulled:
            return  # a true cycle; check() reports it


def check(plans: Sequence[RankPlan]) -> None:
    sent: Dict[Tuple[int, int], List[Label]] = {}
    received: Dict[Tuple[int, int], List[Label]] = {}
    for r, p in enumerate(plans):
        for b in p.batches:
            for t in b.sends:
                sent.setdefault((r, t.peer), []).append(t.label)
            for t in b.recvs:
                received.setdefault((t.peer, r), []).append(t.label)
    for channel in sorted(set(sent) | set(received)):
        s, rcv = sent.get(channel, []), received.get(channel, [])
        if s != rcv:
            i = next((i for i, (x, y) in enumerate(zip(s, rcv)) if x != y), min(len(s), len(rcv)))
            raise CommPlanError(
                f"rank {channel[0]} -> rank {channel[1]}: message {i} is sent as "
                f"{s[i] if i < len(s) else 'nothing'} but received as {rcv[i] if i < len(rcv) else 'nothing'}")
    _check_progress(plans)


def _check_progress(plans: Sequence[RankPlan]) -> None:
    """Batches complete only when every operation in them is matched (NCCL group semantics)."""
    n = len(plans)
    at = [0] * n                       # index of the batch each rank is blocked in
    posted_s: Dict[Tuple[int, int], int] = {}  # how many sends on a channel have been posted
    posted_r: Dict[Tuple[int, int], int] = {}
    order_s: List[List[List[Tuple[Tuple[int, int], int]]]] = []  # per rank, per batch, (channel, index)
    order_r: List[List[List[Tuple[Tuple[int, int], int]]]] = []
    count_s: Dict[Tuple[int, int], int] = {}
    count_r: Dict[Tuple[int, int], int] = {}
    for r, p in enumerate(plans):
        order_s.append([])
        order_r.append([])
        for b in p.batches:
            ss, rr = [], []
            for t in b.sends:
                ch = (r, t.peer)
                ss.append((ch, count_s.get(ch, 0)))
                count_s[ch] = count_s.get(ch, 0) + 1
            for t in b.recvs:
                ch = (t.peer, r)
                rr.append((ch, count_r.get(ch, 0)))
                count_r[ch] = count_r.get(ch, 0) + 1
            order_s[-1].append(ss)
            order_r[-1].append(rr)

    def post(r: int) -> None:
        if at[r] < len(plans[r].batches):
            for ch, i in order_s[r][at[r]]:
                posted_s[ch] = max(posted_s.get(ch, 0), i + 1)
            for ch, i in order_r[r][at[r]]:
                posted_r[ch] = max(posted_r.get(ch, 0), i + 1)

    for r in range(n):
        post(r)
    progress = True
    while progress:
        progress = False
        for r in range(n):
            if at[r] >= len(plans[r].batches):
                continue
            ok = all(posted_r.get(ch, 0) > i for ch, i in order_s[r][at[r]]) and \
                all(posted_s.get(ch, 0) > i for ch, i in order_r[r][at[r]])
            if ok:
                at[r] += 1
                post(r)
                progress = True
    stuck = [r for r in range(n) if at[r] < len(plans[r].batches)]
    if stuck:
        parts = []
        for r in stuck:
            b = plans[r].batches[at[r]]
            parts.append(f"rank {r} before unit {b.unit}: sends {[(t.peer, t.label) for t in b.sends]} "
                         f"recvs {[(t.peer, t.label) for t in b.recvs]}")
        raise CommPlanError("communication plan deadlocks: " + "; ".join(parts))

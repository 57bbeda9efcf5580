"""The communication pass: which tensors each rank sends and receives around each action.

* Before each execution unit a rank posts ONE batch, one ``batch_isend_irecv`` as in DeepSeek's
  reference: the sends of its previous unit and the receives its unit needs.
* Where that would deadlock (two ranks each sending to the other first), the planner moves the
  receive into the batch the receiving rank is blocked in: the reference's hand-made prefetch.
* NCCL matches one direction's messages between two ranks in posting order, so the checker
  proves the sender's order equals the receiver's on every channel and that the batches complete
  when a batch finishes only once all its operations are matched: no deadlock on NCCL or gloo.

A transfer's label: ``("act" | "grad", dir, mb, stage)``, ``stage`` the one that consumes it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

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
    """Per rank and action: the tensors it takes and hands on, one per dependency on another
    stage's event (``deps.waits_for``)."""
    where: Dict[Event, Tuple[int, int]] = {event_of(a): (r, i) for r, acts in enumerate(ranks)
                                           for i, a in enumerate(acts)}
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
    """Plan every rank and check the plan (raises :class:`CommPlanError`): a receive is posted no
    later than its unit needs it and in the order the peer sends on its channel (prefetched where
    that is earlier)."""
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


#: A channel: (sending rank, receiving rank).
Channel = Tuple[int, int]
#: One batch's operations as (channel number, index of the message on its channel): (sends, receives).
Posting = Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]


class _Strict:
    """Ranks posting their batches in order, each finishing only when all its operations are
    matched (NCCL group semantics). A worklist: a rank is re-checked only when a peer posts to it,
    and the settled state is the same in any order (posting only lets more batches finish).
    ``order[r][k]``: batch k of rank r; channels are numbers into ``ends`` (lists, not dicts: this
    runs once per operation of schedules with thousands of ranks)."""

    def __init__(self, order: List[List[Posting]], ends: List[Channel]):
        self.order, self.ends = order, ends
        self.at = [0] * len(order)         # the batch each rank is blocked in
        self.sent = [0] * len(ends)        # sends posted per channel (a prefix of its order)
        self.received = [0] * len(ends)    # receives posted per channel
        for r in range(len(order)):
            if order[r]:
                self._post(r, [])

    def finished(self, r: int) -> bool:
        return self.at[r] >= len(self.order[r])

    def _post(self, r: int, woken: List[int]) -> None:
        """Post rank ``r``'s current batch (it has one); add the peers it may unblock to ``woken``."""
        sends, recvs = self.order[r][self.at[r]]
        for c, i in sends:
            self.sent[c] = max(self.sent[c], i + 1)
            woken.append(self.ends[c][1])
        for c, i in recvs:
            self.received[c] = max(self.received[c], i + 1)
            woken.append(self.ends[c][0])

    def settle(self, todo: List[int]) -> List[int]:
        """Let the ranks in ``todo`` (and those they unblock) run on; return the ranks that moved."""
        sent, received, at, moved = self.sent, self.received, self.at, []
        while todo:
            r = todo.pop()
            batches = self.order[r]
            while at[r] < len(batches):
                sends, recvs = batches[at[r]]
                if not (all(received[c] > i for c, i in sends) and all(sent[c] > i for c, i in recvs)):
                    break
                at[r] += 1
                moved.append(r)
                if at[r] < len(batches):
                    self._post(r, todo)
        return moved


#: Per rank, (channel number, index) of each receive -> the batch that holds it.
Where = List[Dict[Tuple[int, int], int]]


def _channel_index(plans: List[RankPlan]) -> Tuple[List[List[Posting]], List[Channel], Where]:
    """Each batch's operations as (channel number, index on the channel in the sender's order),
    the channels' ends, and per rank which batch holds the receive of each (channel, index)."""
    index: Dict[Tuple[Channel, Label], int] = {}
    ids: Dict[Channel, int] = {}  # channel -> its number, in order of first sight
    counts: List[int] = []
    order: List[List[Posting]] = [[([], []) for _ in p.batches] for p in plans]
    for r, p in enumerate(plans):
        for k, b in enumerate(p.batches):
            for t in b.sends:
                c = ids.setdefault((r, t.peer), len(ids))
                if c == len(counts):
                    counts.append(0)
                index[((r, t.peer), t.label)] = counts[c]
                order[r][k][0].append((c, counts[c]))
                counts[c] += 1
    where: Where = [dict() for _ in plans]
    for q, p in enumerate(plans):
        for k, b in enumerate(p.batches):
            for t in b.recvs:
                ch = (t.peer, q)
                if (ch, t.label) not in index:
                    raise CommPlanError(f"rank {q} receives {t.label} from rank {t.peer}, which never sends it")
                op = (ids[ch], index[(ch, t.label)])
                order[q][k][1].append(op)
                where[q][op] = k
    return order, list(ids), where


def _prefetch_where_needed(plans: List[RankPlan]) -> None:
    """Run the batches under strict semantics; when every rank is blocked, pull the receive that
    matches a blocked send (with the channel's earlier receives) into the receiver's current batch:
    for the first such send of the lowest rank, so the plan does not depend on the visiting order."""
    order, ends, where = _channel_index(plans)
    state = _Strict(order, ends)
    # Ranks that may hold a send to pull for: a rank's chance only shrinks until it moves on.
    candidates = list(range(len(plans)))
    todo: Optional[List[int]] = candidates[:]
    while todo is not None:  # None: every rank finished, or a true cycle that check() reports
        for r in state.settle(todo):
            heapq.heappush(candidates, r)
        todo = _pull(plans, state, where, candidates)


def _pull(plans: List[RankPlan], state: _Strict, where: Where, candidates: List[int]) -> Optional[List[int]]:
    """Pull receives for the first unmatched send of the lowest blocked rank; return the two ranks."""
    while candidates:
        r = candidates[0]
        if not state.finished(r):
            for c, i in state.order[r][state.at[r]][0]:
                q = state.ends[c][1]
                if state.received[c] <= i and not state.finished(q):
                    _move_receives(plans[q], state.order[q], where[q], c, range(state.received[c], i + 1),
                                   state.at[q])
                    state.received[c] = i + 1
                    return [r, q]
        heapq.heappop(candidates)
    return None


def _move_receives(p: RankPlan, order: List[Posting], where: Dict[Tuple[int, int], int], c: int,
                   indices: range, target: int) -> None:
    """Move the receives ``indices`` of channel ``c`` into batch ``target`` (the plan's and ``order``'s)."""
    for j in indices:
        k = where[(c, j)]
        x = order[k][1].index((c, j))
        order[target][1].append(order[k][1].pop(x))
        p.batches[target].recvs.append(p.batches[k].recvs.pop(x))
        where[(c, j)] = target


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
    """Batches complete only when every operation in them is matched (NCCL group semantics);
    after :func:`check` matched every channel's labels, so a receive's index is its label's."""
    order, ends, _ = _channel_index(plans)
    state = _Strict(order, ends)
    state.settle(list(range(len(plans))))
    stuck = [r for r in range(len(plans)) if not state.finished(r)]
    if stuck:
        parts = []
        for r in stuck:
            b = plans[r].batches[state.at[r]]
            parts.append(f"rank {r} before unit {b.unit}: sends {[(t.peer, t.label) for t in b.sends]} "
                         f"recvs {[(t.peer, t.label) for t in b.recvs]}")
        raise CommPlanError("communication plan deadlocks: " + "; ".join(parts))

"""The planner's worklist (a rank re-checked only when a peer posts to it) gives the plans, and the
errors, of the plain definition: every rank swept round-robin until nothing moves, then one receive
pulled for the first blocked send of the lowest rank. The sweeps, kept here as the reference, cost
ranks x sweeps (1f1b pp=2048: 20 s a plan); the worklist costs the operations."""
import dataclasses
import random

import pytest

from megatron_dualpipe.schedule import build_schedule, comm
from megatron_dualpipe.schedule.actions import F


def _sweep(plans, index, pull):
    """Run every rank's batches by sweeps; ``pull(at, received)`` at each stop, until it returns False."""
    at, sent, received = [0] * len(plans), {}, {}

    def post(r):
        for t in plans[r].batches[at[r]].sends if at[r] < len(plans[r].batches) else []:
            sent[(r, t.peer)] = max(sent.get((r, t.peer), 0), index(r, t.peer, t.label) + 1)
        for t in plans[r].batches[at[r]].recvs if at[r] < len(plans[r].batches) else []:
            received[(t.peer, r)] = max(received.get((t.peer, r), 0), index(t.peer, r, t.label) + 1)

    def done(r):
        b = plans[r].batches[at[r]]
        return all(received.get((r, t.peer), 0) > index(r, t.peer, t.label) for t in b.sends) and \
            all(sent.get((t.peer, r), 0) > index(t.peer, r, t.label) for t in b.recvs)

    for r in range(len(plans)):
        post(r)
    while True:
        moved = True
        while moved:
            moved = False
            for r in range(len(plans)):
                while at[r] < len(plans[r].batches) and done(r):
                    at[r], moved = at[r] + 1, True
                    post(r)
        if not pull(at, received):
            return at


def _channel_order(plans):
    """Each channel's labels in the sender's order, and a transfer's index on it."""
    order = {}
    for r, p in enumerate(plans):
        for b in p.batches:
            for t in b.sends:
                order.setdefault((r, t.peer), []).append(t.label)
    return order, lambda src, dst, label: order[(src, dst)].index(label)


def _reference_prefetch(plans):
    """The sweeping prefetch."""
    order, index = _channel_order(plans)

    def pull(at, received):
        for r, p in enumerate(plans):
            for t in p.batches[at[r]].sends if at[r] < len(p.batches) else []:
                q, ch, i = t.peer, (r, t.peer), index(r, t.peer, t.label)
                if received.get(ch, 0) > i or at[q] >= len(plans[q].batches):
                    continue
                for j in range(received.get(ch, 0), i + 1):
                    b, x = next((b, x) for b in plans[q].batches for x in b.recvs
                                if x.peer == r and x.label == order[ch][j])
                    b.recvs.remove(x)
                    plans[q].batches[at[q]].recvs.append(x)
                received[ch] = i + 1
                return True
        return False

    _sweep(plans, index, pull)


def _reference_progress(plans):
    """The sweeping check (after check() found every channel's orders equal)."""
    at = _sweep(plans, _channel_order(plans)[1], lambda *_: False)
    stuck = [(r, p.batches[at[r]]) for r, p in enumerate(plans) if at[r] < len(p.batches)]
    if stuck:
        raise comm.CommPlanError("communication plan deadlocks: " + "; ".join(
            f"rank {r} before unit {b.unit}: sends {[(t.peer, t.label) for t in b.sends]} "
            f"recvs {[(t.peer, t.label) for t in b.recvs]}" for r, b in stuck))


def _outcome(layout, ranks):
    try:
        return repr(comm.plan(layout, ranks))
    except (comm.CommPlanError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _variants(s, rng):
    """The order, its forwards alone, unfused, and a few with actions swapped on one rank (most deadlock)."""
    plain = tuple(tuple(dataclasses.replace(a, overlap=False) for a in r) for r in s.ranks)
    yield s.ranks
    yield tuple(tuple(a for a in r if a.op == F) for r in plain)
    yield plain
    for n in range(8):
        ranks = [list(r) for r in plain]
        for _ in range(1 + n % 3):
            r = rng.randrange(s.pp)
            i = rng.randrange(len(ranks[r]) - 1)
            j = min(len(ranks[r]) - 1, i + 1 + rng.randrange(3))
            ranks[r][i], ranks[r][j] = ranks[r][j], ranks[r][i]
        yield ranks


CASES = [("1f1b", 4, 8), ("zb-h1", 3, 7), ("dualpipe", 2, 4), ("dualpipe", 4, 8), ("dualpipe", 6, 14),
         ("dualpipev", 3, 6), ("dualpipev", 4, 11), ("interleaved-1f1b", 4, 8), ("interleaved-1f1b-a2a", 2, 6)]


@pytest.mark.parametrize("name,pp,m", CASES)
def test_worklist_plans_equal_the_sweeping_definition(name, pp, m, monkeypatch):
    s = build_schedule(name, pp, m)
    variants = list(_variants(s, random.Random(f"{name}{pp}{m}")))
    got = [_outcome(s.layout, ranks) for ranks in variants]
    monkeypatch.setattr(comm, "_prefetch_where_needed", _reference_prefetch)
    monkeypatch.setattr(comm, "_check_progress", _reference_progress)
    want = [_outcome(s.layout, ranks) for ranks in variants]
    print(f"\n{name} pp={pp} M={m}: {len(variants)} orders ({sum('Error' in w for w in want)} refused), "
          f"worklist equal to sweeps: {got == want}")
    assert got == want

"""The communication pass: every schedule gets a plan whose channels match and cannot deadlock,
and the checker rejects plans that would swap tensors or hang."""
import copy

import pytest

from megatron_dualpipe.schedule import build_schedule
from megatron_dualpipe.schedule.comm import Batch, CommPlanError, RankPlan, Transfer, check, plan

CASES = [(name, pp, m) for name in ("1f1b", "zb-h1", "dualpipe", "dualpipev") for pp in range(1, 17)
         if not (name == "dualpipe" and pp % 2) for m in sorted({2 * pp, 2 * pp + 2, 3 * pp + (3 * pp) % 2})]


@pytest.mark.parametrize("name,pp,m", CASES)
def test_every_schedule_has_a_checked_plan(name, pp, m):
    s = build_schedule(name, pp, m)
    plans = plan(s.layout, s.ranks)
    # Every cross-rank dependency is carried exactly once, and received no later than needed.
    sends = sum(len(b.sends) for p in plans for b in p.batches)
    recvs = sum(len(b.recvs) for p in plans for b in p.batches)
    assert sends == recvs
    for r, p in enumerate(plans):
        for b in p.batches:
            assert 0 <= b.unit <= len(p.units)


def test_prefetch_is_needed_and_done_for_dualpipe():
    """DualPipe pp=2: both ranks send before they receive; the plan posts receives early."""
    s = build_schedule("dualpipe", 2, 4)
    plans = plan(s.layout, s.ranks)
    early = [(r, b.unit) for r, p in enumerate(plans) for b in p.batches
             for t in b.recvs if t.label[0] == "act" and b.unit < _need(p, s.ranks[r], t.label)]
    print(f"\nreceives posted before the unit that needs them: {early}")
    assert early


def _need(p, acts, label):
    for k, unit in enumerate(p.units):
        for i in unit:
            a = acts[i]
            kind = "act" if a.op == "F" else "grad"
            if (kind, a.dir, a.mb, a.stage) == label and a.op in ("F", "B", "BW"):
                return k
    raise AssertionError(label)


def test_checker_rejects_swapped_channel_order():
    s = build_schedule("1f1b", 2, 4)
    plans = copy.deepcopy(plan(s.layout, s.ranks))
    recvs = [(b, t) for b in plans[1].batches for t in b.recvs]
    (b0, t0), (b1, t1) = recvs[0], recvs[1]
    b0.recvs[b0.recvs.index(t0)], b1.recvs[b1.recvs.index(t1)] = t1, t0
    with pytest.raises(CommPlanError, match="rank 0 -> rank 1: message 0 is sent as"):
        check(plans)


def test_checker_rejects_a_plan_that_deadlocks():
    a, b = ("act", 0, 0, 1), ("act", 1, 0, 1)
    plans = [RankPlan([(0,), (1,)], [Batch(0, [Transfer(1, a)], []), Batch(1, [], [Transfer(1, b)])]),
             RankPlan([(0,), (1,)], [Batch(0, [Transfer(0, b)], []), Batch(1, [], [Transfer(0, a)])])]
    with pytest.raises(CommPlanError, match="deadlocks: rank 0 before unit 0"):
        check(plans)

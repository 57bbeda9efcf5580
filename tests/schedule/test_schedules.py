"""Structural checks of every generated schedule: each forward and backward exactly once, on
the rank that holds its stage, in an order the simulator can complete."""
from collections import Counter

import pytest

from megatron_dualpipe.schedule import SCHEDULES, ScheduleError, build_schedule
from megatron_dualpipe.schedule.actions import B, BW, F, W
from megatron_dualpipe.schedule.simulate import Costs, simulate


def _cases():
    for name in SCHEDULES:
        for pp in range(1, 17):
            if name == "dualpipe" and pp % 2:
                continue
            if name in ("1f1b", "zb-h1"):
                ms = sorted({1, max(1, pp - 1), pp, pp + 1, 2 * pp + 3})
            elif pp <= 8:
                ms = sorted({2 * pp, 2 * pp + 2, 3 * pp + (pp % 2)})
            else:  # the big ones cost the simulator most: the smallest M and one more
                ms = [2 * pp, 2 * pp + 2]
            if name == "dualpipev":
                ms = sorted(set(ms) | {2 * pp + 1})  # dualpipev takes odd M too
            for m in ms:
                yield name, pp, m


CASES = list(_cases())


def _per_direction(s):
    if s.name == "dualpipe":
        return {0: s.microbatches // 2, 1: s.microbatches // 2}
    if s.name == "dualpipev":
        return {0: s.microbatches, 1: s.microbatches}
    return {0: s.microbatches}


@pytest.mark.parametrize("name,pp,m", CASES, ids=[f"{n}-pp{p}-m{m}" for n, p, m in CASES])
def test_structure(name, pp, m):
    s = build_schedule(name, pp, m)
    assert len(s.ranks) == pp
    per_dir = _per_direction(s)
    assert s.microbatches_per_direction() == per_dir
    expected = {(d, mb, st) for d, n in per_dir.items() for st in s.layout.stages(d) for mb in range(n)}

    forwards, backwards = Counter(), Counter()
    for r, acts in enumerate(s.ranks):
        pos = {}
        for i, a in enumerate(acts):
            key = (a.dir, a.mb, a.stage)
            # The action's stage lives on this rank.
            assert s.layout.rank_of(a.dir, a.stage) == r, f"rank {r} runs {a} of stage {a.stage}"
            assert s.layout.stage_on(r, a.dir) == a.stage
            pos[(a.op, key)] = i
            if a.op == F:
                forwards[key] += 1
            elif a.op in (B, BW):
                backwards[key] += 1
                assert (F, key) in pos, f"rank {r}: {a} before its forward"
            else:
                assert a.op == W
                assert (B, key) in pos, f"rank {r}: {a} before its B"
            if a.overlap:
                assert a.op == F
                assert i + 1 < len(acts) and acts[i + 1].op in (B, BW), f"rank {r}: {a} not followed by a backward"
            if a.op != F:
                assert not a.overlap
        # One backward per forward: a BW, or a B with exactly one W after it.
        ops = Counter((a.op, (a.dir, a.mb, a.stage)) for a in acts)
        for (op, key), n in ops.items():
            assert n == 1, f"rank {r} runs {op}{key} {n} times"
            if op == B:
                assert ops[(W, key)] == 1 and ops[(BW, key)] == 0
            if op == W:
                assert ops[(B, key)] == 1
            if op == BW:
                assert ops[(B, key)] == 0 and ops[(W, key)] == 0
    assert set(forwards) == expected and set(forwards.values()) == {1}
    assert set(backwards) == expected and set(backwards.values()) == {1}
    if name in ("1f1b", "zb-h1"):
        assert all(not a.overlap for acts in s.ranks for a in acts)
        assert all(a.op != ("B" if name == "1f1b" else "BW") for acts in s.ranks for a in acts)
    # The simulator completes (no deadlock) and every action gets a span.
    res = simulate(s.layout, s.ranks, Costs(1, 2, 1, 3))
    for r, acts in enumerate(s.ranks):
        tl = res.ranks[r]
        assert all(e >= st for st, e in zip(tl.starts, tl.ends))
        assert max(tl.ends, default=0) <= res.makespan


def test_dualpipe_and_dualpipev_fuse_forward_with_backward():
    for name, pp, m in (("dualpipe", 8, 20), ("dualpipev", 4, 10)):
        s = build_schedule(name, pp, m)
        assert any(a.overlap for a in s.ranks[0])


@pytest.mark.parametrize("name,pp,m,needles", [
    ("nope", 4, 8, ["unknown schedule", "1f1b", "zb-h1", "dualpipe", "dualpipev"]),
    ("1f1b", 0, 4, ["pipeline size", "got 0"]),
    ("zb-h1", 4, 0, ["micro-batches", "got 0"]),
    ("dualpipe", 3, 8, ["even pipeline size", "got 3", "--pp to 4", "dualpipev"]),
    ("dualpipe", 5, 20, ["got 5", "--pp to 6"]),
    ("dualpipe", 4, 6, [">= 2*pp=8", "got 6", "use 8"]),
    ("dualpipe", 4, 9, ["even number", "got 9", "use 10"]),
    ("dualpipe", 8, 12, [">= 2*pp=16", "use 16"]),
    ("dualpipev", 4, 7, ["2*pp=8", "got 7", "use 8"]),
    ("dualpipev", 6, 1, ["2*pp=12", "use 12"]),
])
def test_validation_messages(name, pp, m, needles):
    with pytest.raises(ScheduleError) as e:
        build_schedule(name, pp, m)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_schedule_error_is_value_error():
    assert issubclass(ScheduleError, ValueError)

"""schedule.iteration_plan: an iteration's whole communication, checked under NCCL stream semantics.

Standard library only. The plan holds every rank's compute units, P2P batches, bd sums, data-
parallel reductions, loss gather and finalize all-reduce, issued as the executor issues them;
the check runs them under NCCL's rules (stream order, one stream per communicator, stream waits
block everything later, collectives complete when all ranks started them) and names the cycle
of a plan that cannot complete.

* Issue 17's hang: with GradReduction's old stream wait right after each bd sum, pp=2 M=3
  deadlocks; the check names the cycle (rank 0's sum waits for rank 1's, which sits behind a
  receive of a tensor rank 0 posts only after its wait).
* Every accepted (schedule, pp, M, zero bubble, overlap-grad-reduce, dp) over pp 2..8 even and
  M from pp to 4pp, and pp 16 at the edges of M, has no cycle with today's waits; the old waits'
  cycles are counted and printed.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import pytest

from megatron_dualpipe.schedule import build_schedule, registry
from megatron_dualpipe.schedule import iteration_plan as IP
from megatron_dualpipe.schedule.comm import plan


@functools.lru_cache(maxsize=None)
def _program(name, pp, padded):
    s = build_schedule(name, pp, padded)
    return s.ranks, tuple(plan(s.layout, s.ranks))


@functools.lru_cache(maxsize=None)
def _forward_program(name, pp, padded):
    """As the executor compiles forward-only: the forwards alone, none fused."""
    s = build_schedule(name, pp, padded)
    ranks = [[dataclasses.replace(a, overlap=False) for a in r if a.op == "F"] for r in s.ranks]
    return ranks, tuple(plan(s.layout, ranks))


def _check(name, pp, m, zb, ogr=True, dp=2, forward_only=False, wait=IP.WAIT_AT_FINISH, pg=True):
    spec = registry.get(name)
    ranks, plans = _program(name, pp, spec.padded_microbatches(pp, m))
    if forward_only:
        ranks, plans = _forward_program(name, pp, spec.padded_microbatches(pp, m, True))
    return IP.plan_for(spec, pp, m, ranks, plans, zero_bubble=zb, overlap_grad_reduce=ogr, dp=dp,
                       forward_only=forward_only, sum_wait=wait, param_gather=pg)


def test_issue_17_cycle_is_found_and_named():
    """pp=2, M=3 with the stream waiting right after each bd sum (the code before the fix)."""
    with pytest.raises(IP.IterationPlanError) as e:
        _check("dualpipe", 2, 3, True, wait=IP.WAIT_AT_ISSUE)
    msg = str(e.value)
    print("\n" + msg)
    for part in ("deadlocks under NCCL stream semantics", "rank 0's bd sum of stage 1 (issued after action 3 (BW1.0))",
                 "rank 1's bd sum of stage 1 (issued after action 6 (BW0.1))", "rank 0's P2P batch posted before action 4",
                 "right after issuing the bd sum of stage 1", "again"):
        assert part in msg, f"{part!r} not in {msg!r}"
    ip = _check("dualpipe", 2, 3, True)  # waited at the end of the schedule: no cycle
    assert ip.sum_points == [[(3, 1), (8, 0)], [(6, 0), (6, 1)]]  # the pair's sums in the same order of stages


def test_a_collective_issued_differently_is_refused():
    ip = _check("dualpipe", 4, 8, True)
    bd = [w for w in ip.works if w.comm == "bd" and w.rank == 0]
    bd[0].key = ("bd sum", 99)
    with pytest.raises(IP.IterationPlanError, match="not the same on every rank"):
        IP.check(ip)


def _param_gathers(ip, r):
    """{chunk: (item index of its all-gathers' post, of their wait, computes before the wait)}."""
    out = {}
    for k, it in enumerate(ip.items[r]):
        key = ip.works[it.work].key if it.work >= 0 else None
        if key and key[0] == "param all-gather":
            computes = sum(1 for x in ip.items[r][:k] if x.kind == "compute")
            out.setdefault(key[1], []).append((k, computes))
    return {c: (post[0], wait[0], wait[1]) for c, (post, wait) in out.items()}


@pytest.mark.parametrize("name,pp,m", [("dualpipe", 4, 5), ("dualpipev", 4, 9), ("executor-1f1b", 4, 6)])
def test_param_gathers_start_before_the_first_action_and_wait_at_each_chunks_first_forward(name, pp, m):
    """--overlap-param-gather: every rank posts each chunk's all-gathers before its first unit (a
    fixed place, the same on every data-parallel replica), in the order of the chunks' first real
    forwards (DualPipe's ranks pp/2.. run chunk 1 first), and its stream waits for them right before
    the unit of the chunk's first real forward (fake micro-batches run nothing); at dp = 1 there are
    none."""
    spec = registry.get(name)
    ip = _check(name, pp, m, True)
    ranks, _ = _program(name, pp, spec.padded_microbatches(pp, m))
    for r, acts in enumerate(ranks):
        us = IP.units(acts)
        first = {}
        for u, unit in enumerate(us):
            for i in unit:
                a = acts[i]
                if a.op == "F" and not spec.is_fake(m, a.dir, a.mb):
                    first.setdefault(a.dir, u)
        got = _param_gathers(ip, r)
        print(f"{name} pp={pp} M={m} rank {r}: chunk -> (post item, wait item, units before the wait) {got}; "
              f"first real forward's unit {first}")
        assert sorted(got) == sorted(first)
        first_compute = next(k for k, it in enumerate(ip.items[r]) if it.kind == "compute")
        assert all(post < first_compute for post, _, _ in got.values())
        assert sorted(got, key=lambda c: got[c][0]) == sorted(first, key=first.get)  # first needed, first posted
        assert all(got[c][2] == first[c] for c in got)
    assert not any(_param_gathers(_check(name, pp, m, True, dp=1), r) for r in range(pp))


def _accepted(name, pp):
    spec = registry.get(name)
    if spec.pp_problem(pp):
        return []
    out = []
    for m in range(pp, 4 * pp + 1):
        try:
            spec.padded_microbatches(pp, m)
        except registry.ScheduleError:
            continue
        out.append(m)
    return out


#: The schedules with bd sums (the only collectives during the schedule) up to pp = 16; the
#: one-chunk orders (P2P, loss gather, finalize only) up to pp = 8.
SWEEP = {name: (16 if registry.get(name).chunks_per_rank == 2 else 8) for name in registry.names(registry.EXECUTOR)}
#: Every accepted M from pp to 4pp is checked up to this pp. Above it (the check's cost grows
#: about as pp^4: dualpipev at pp = 16 alone took 22 s of the sweep's 85 s), only the largest pp and
#: its edges of M: M = pp (the fewest), pp + 1 (odd), 2pp - 1 (pp <= M < 2pp, the last odd one),
#: 2pp, 2pp + 1 and 4pp. pp 10..14 have the same kinds of (pp, M) as pp <= 8 and pp 16 (odd and
#: even M, pp <= M < 2pp, M >= 2pp): the schedules are built by one rule for every even pp.
FULL_M_UP_TO_PP = 8


def _swept(name):
    """(pp, M) of the sweep of `name` (see FULL_M_UP_TO_PP)."""
    out = []
    for pp in range(2, SWEEP[name] + 1, 2):
        if pp <= FULL_M_UP_TO_PP or pp == SWEEP[name]:
            edges = {pp, pp + 1, 2 * pp - 1, 2 * pp, 2 * pp + 1, 4 * pp}
            out += [(pp, m) for m in _accepted(name, pp) if pp <= FULL_M_UP_TO_PP or m in edges]
    return out


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_no_accepted_case_has_a_cycle(name):
    """Every accepted M from pp to 4pp, pp even up to 8, and the largest pp (SWEEP[name]) at the
    edges of M (`_swept`), zero bubble on and off, with --overlap-grad-reduce and
    --overlap-param-gather at dp=2 (its data-parallel collectives only add works that complete by
    themselves, so dp=1 and no overlap are sub-plans), and forward-only. The old wait right after
    each bd sum is checked too (zero bubble, pp <= 8, schedules with bd sums) and its cycles counted."""
    t0 = time.monotonic()
    bidirectional = registry.get(name).layout(2).kind == "bidirectional"
    checked, old_checked, old_cycles = 0, 0, []
    for pp, m in _swept(name):
        for zb in (True, False):
            _check(name, pp, m, zb)
            checked += 1
        _check(name, pp, m, True, forward_only=True)
        checked += 1
        if pp <= 8 and bidirectional:
            old_checked += 1
            try:
                _check(name, pp, m, True, wait=IP.WAIT_AT_ISSUE)
            except IP.IterationPlanError:
                old_cycles.append((pp, m))
    print(f"\n{name}: {checked} cases without a cycle ({time.monotonic() - t0:.1f} s); with the old wait right after "
          f"each bd sum, {len(old_cycles)} of {old_checked} (pp, M) cycle: {old_cycles}")
    assert checked > 0
    if bidirectional:
        assert (2, 3) in old_cycles  # the model does see issue 17's hang

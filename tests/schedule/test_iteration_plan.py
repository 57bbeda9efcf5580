"""schedule.iteration_plan: an iteration's whole communication, checked under NCCL stream semantics.

Standard library only. The plan holds every rank's compute units, P2P batches, bd sums, data-
parallel reductions, loss gather and finalize all-reduce, issued as the executor issues them;
the check runs them under NCCL's rules (stream order, one stream per communicator, stream waits
block everything later, collectives complete when all ranks started them) and names the cycle
of a plan that cannot complete.

* Issue 17's hang: with GradReduction's old stream wait right after each bd sum (a program built
  here with each ``summed`` right after its ``sum``), pp=2 M=3 deadlocks; the check names the cycle (rank 0's sum waits for rank 1's, which sits behind a
  receive of a tensor rank 0 posts only after its wait).
* Every accepted (schedule, pp, M, zero bubble, overlap-grad-reduce, dp) over pp 2..8 even and
  M from pp to 4pp, and pp 16 at the edges of M, has no cycle with today's waits; the old waits'
  cycles are counted and printed.
* The data-parallel reductions are posted at the plan's points (``dp_points``, what GradReduction
  reads), after the chunk's gradients are final; replicas (``replicated``) that start them in
  another order, or where a poll saw a bd sum complete (the rule before issue 28: a deadlock on
  one hardware queue), or before the bd sum is waited, are caught and named.
* One hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``): the schedules without bd sums have no
  cycle; DualPipe's cycles are counted and printed.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import pytest

from megatron_dualpipe.schedule import iteration_plan as IP
from megatron_dualpipe.schedule import registry
from megatron_dualpipe.schedule.actions import units
from megatron_dualpipe.schedule.lowering import Op, OpKind
from megatron_dualpipe.schedule.lowering.program import ProgramOptions, build_program
from megatron_dualpipe.schedule.lowering.reductions import grad_ops, last_grad_action_index, place_reductions


def _check(name, pp, m, zb, ogr=True, dp=2, forward_only=False, pg=True, one_queue=False):
    padded = registry.get(name).padded_microbatches(pp, m, forward_only)
    options = ProgramOptions(zero_bubble=zb, overlap_grad_reduce=ogr, dp=dp, param_gather=pg)
    return IP.plan_for(build_program(name, pp, padded, m, forward_only, options), one_queue=one_queue)


#: The sweeps' plans (pp <= FULL_M_UP_TO_PP, checked, not changed after): the cycle sweep and the
#: one-queue sweep plan the same cases, a third of their time before.
_swept_plan = functools.lru_cache(maxsize=None)(_check)


def _waiting_at_issue(ip):
    """The plan of the code before issue 17's fix: each bd sum waited right after it is issued."""
    def ops(rank_ops):
        out = []
        for op in rank_ops:
            if op.kind is not OpKind.SUMMED:
                out += [op, Op(OpKind.SUMMED, op.index)] if op.kind is OpKind.SUM else [op]
        return tuple(out)

    return IP.build(dataclasses.replace(ip.program, ops=tuple(ops(x) for x in ip.program.ops)))


def test_issue_17_cycle_is_found_and_named():
    """pp=2, M=3 with the stream waiting right after each bd sum (the code before the fix)."""
    with pytest.raises(IP.IterationPlanError) as e:
        IP.check(_waiting_at_issue(_check("dualpipe", 2, 3, True)))
    msg = str(e.value)
    print("\n" + msg)
    for part in ("deadlocks under NCCL stream semantics", "rank 0's bd sum of stage 1 (issued after action 3 (BW1.0))",
                 "rank 1's bd sum of stage 1 (issued after action 6 (BW0.1))", "rank 0's P2P batch posted before action 4",
                 "right after issuing the bd sum of stage 1", "again"):
        assert part in msg, f"{part!r} not in {msg!r}"
    ip = _check("dualpipe", 2, 3, True)  # waited at the end of the schedule: no cycle
    assert ip.program.sum_points == (((3, 1), (8, 0)), ((6, 0), (6, 1)))  # the pair's sums in the same order of stages


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
    the unit of the chunk's first real forward (fake micro-batches run nothing); at dp = 1 the same,
    without --overlap-param-gather none."""
    spec = registry.get(name)
    ip = _check(name, pp, m, True)
    ranks = ip.program.actions
    for r, acts in enumerate(ranks):
        us = units(acts)
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
    # the program's gather ops, whatever dp (the executor calls param_sync_func wherever it is set);
    # none without --overlap-param-gather
    assert all(_param_gathers(_check(name, pp, m, True, dp=1), r) == _param_gathers(ip, r) for r in range(pp))
    assert not any(_param_gathers(_check(name, pp, m, True, pg=False), r) for r in range(pp))


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
        plan = _swept_plan if pp <= FULL_M_UP_TO_PP else _check
        for zb in (True, False):
            plan(name, pp, m, zb)
            checked += 1
        _check(name, pp, m, True, forward_only=True)
        checked += 1
        if pp <= 8 and bidirectional:
            old_checked += 1
            try:
                IP.check(_waiting_at_issue(plan(name, pp, m, True)))
            except IP.IterationPlanError:
                old_cycles.append((pp, m))
    print(f"\n{name}: {checked} cases without a cycle ({time.monotonic() - t0:.1f} s); with the old wait right after "
          f"each bd sum, {len(old_cycles)} of {old_checked} (pp, M) cycle: {old_cycles}")
    assert checked > 0
    if bidirectional:
        assert (2, 3) in old_cycles  # the model does see issue 17's hang


def _dp_posts(ip, r):
    """[(chunk, computes before its post, bd-sum waits before it)] of rank r's data-parallel reductions."""
    out, computes, sum_waits = [], 0, 0
    for it in ip.items[r]:
        key = (ip.works[it.work].key if it.work >= 0 else None) or ("",)
        computes += it.kind == "compute"
        sum_waits += it.kind == "wait" and key[0] == "bd sum"
        if it.kind == "post" and key[0] == "dp reduction":
            out.append((key[1], computes, sum_waits))
    return out


@pytest.mark.parametrize("name,pp,m", [("dualpipe", 4, 5), ("dualpipe", 4, 8), ("dualpipev", 4, 9),
                                       ("executor-1f1b", 4, 6), ("zb-h1", 4, 8)])
def test_dp_reductions_start_at_the_plans_points_after_the_gradients_are_final(name, pp, m):
    """--overlap-grad-reduce: each rank posts its chunks' data-parallel reductions at
    ``IterationPlan.dp_points`` (what GradReduction reads), in that order: with bd sums after every
    sum is waited (the end of the schedule); else right after the unit of the chunk's last real
    gradient action (overlapped with the rest of the schedule), except where the rank holds both
    ends of the model (the tied-embedding fold runs first, at the end)."""
    spec = registry.get(name)
    ip = _check(name, pp, m, True)
    ranks = ip.program.actions
    layout = spec.layout(pp)
    ops = grad_ops(spec.defers_weight_grads and any(a.op == "W" for r in ranks for a in r))
    for r, acts in enumerate(ranks):
        us = units(acts)
        unit_of = {i: u for u, unit in enumerate(us) for i in unit}
        last = last_grad_action_index(acts, lambda a: spec.is_fake(m, a.dir, a.mb), ops)
        posts = _dp_posts(ip, r)
        print(f"{name} pp={pp} M={m} rank {r}: plan {ip.program.dp_points[r]}, last gradient action {last}, "
              f"posts (chunk, units before, sum waits before) {posts}")
        assert [c for _, c in ip.program.dp_points[r]] == [c for c, _, _ in posts]
        for (i, c), (_, computes, sum_waits) in zip(ip.program.dp_points[r], posts):
            assert computes == (len(us) if i == len(acts) else unit_of[i] + 1)
            assert computes >= unit_of[last[c]] + 1  # after the chunk's gradients are final
            assert sum_waits == len(ip.program.sum_points[r])  # after every bd sum is waited
            ends = {d for d, s in enumerate(layout.stages_on(r)) if layout.is_first(d, s) or layout.is_last(d, s)}
            at_end = layout.mirrored or len(ends) == 2
            assert (i == len(acts)) == at_end or (i == len(acts) and c not in last)


def _replicas(name, pp, m, *moves):
    """Data-parallel replicas of one plan, one per ``moves``: {rank: [(action index, chunk)]}, where
    that replica's rank starts its data-parallel reductions instead of the plan's points."""
    prog = _check(name, pp, m, True, pg=False).program
    out = []
    for move in moves:
        ops = list(prog.ops)
        for r, points in move.items():
            base = tuple(op for op in ops[r] if op.kind not in (OpKind.SUM, OpKind.SUMMED, OpKind.SETTLE, OpKind.DP))
            ops[r] = place_reductions(base, prog.actions[r], prog.plans[r].units, prog.sum_points[r], points)
        out.append(IP.build(dataclasses.replace(prog, ops=tuple(ops))))
    return IP.replicated(out)


@pytest.mark.parametrize("one_queue", [False, True])
def test_replicas_running_the_plan_have_no_cycle(one_queue):
    """Two replicas at the plan's points, under per-communicator streams and one hardware queue."""
    for name, pp, m in (("dualpipe", 2, 4), ("dualpipe", 4, 8), ("dualpipev", 4, 8)):
        IP.check(_replicas(name, pp, m, {}, {}), one_queue=one_queue)


def test_replicas_starting_the_dp_reductions_in_different_orders_are_named():
    """Replica 1's rank 0 starts its two chunks in the other order: NCCL would pair chunk 1's
    reduction with chunk 0's (a hang, or where sizes agree a wrong sum)."""
    ip = _check("dualpipe", 4, 8, True)
    (_, c0), (_, c1) = ip.program.dp_points[0]
    with pytest.raises(IP.IterationPlanError) as e:
        IP.check(_replicas("dualpipe", 4, 8, {}, {0: ip.program.dp_points[0][::-1]}))
    msg = str(e.value)
    print("\n" + msg)
    assert "collective 0 on the dp communicator of ranks [0, 4] is not the same on every rank" in msg
    assert f"replica 0: rank 0's data-parallel reduction of chunk {c0}" in msg
    assert f"replica 1: rank 0's data-parallel reduction of chunk {c1}" in msg


def test_a_dp_reduction_started_where_a_poll_saw_its_bd_sum_complete_deadlocks_on_one_queue():
    """The start before this fix: where a poll saw the chunk's bd sum complete, a point that differs
    between replicas. dualpipe pp=2 M=4: replica 0's rank 0 saw its chunk 1 summed right after
    issuing it, replica 1's rank 1 its chunk 0; the other replica's same rank only at the end.
    Per-communicator streams complete; on one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) each
    early reduction holds its rank's later P2P until the other replica's rank reaches the end,
    which needs the other early one's P2P: the check names that cycle."""
    prog = _check("dualpipe", 2, 4, True).program
    early = []
    for r in (0, 1):
        i, c = prog.sum_points[r][0]
        assert prog.dp_points[r][0][1] == c  # started first in the plan too: only the place differs
        early.append({r: [(i, c)] + list(prog.dp_points[r][1:])})
    print(f"\nbd sum points {prog.sum_points}; dp points {prog.dp_points}; early starts per replica {early}")
    plan = _replicas("dualpipe", 2, 4, *early)
    IP.check(plan)  # NCCL's per-communicator streams: no cycle
    with pytest.raises(IP.IterationPlanError) as e:
        IP.check(plan, one_queue=True)
    msg = str(e.value)
    print(msg)
    for part in ("deadlocks under NCCL stream semantics", "one hardware queue behind",
                 "replica 0: rank 0's data-parallel reduction of chunk", "(started after action",
                 "replica 1: rank 0's data-parallel reduction of chunk", "(started at the end of the schedule", "again"):
        assert part in msg, f"{part!r} not in {msg!r}"


def test_a_dp_reduction_before_its_bd_sum_is_named():
    """A data-parallel reduction posted before the chunk's bd sum is issued and waited would reduce
    one copy of the stage: the check names it (under either stream rule)."""
    prog = _check("dualpipe", 4, 8, True).program
    i, c = prog.sum_points[1][-1]
    early = [(i - 1 if cc == c else j, cc) for j, cc in prog.dp_points[1]]
    for one_queue in (False, True):
        with pytest.raises(IP.IterationPlanError) as e:
            IP.check(_replicas("dualpipe", 4, 8, {1: early}), one_queue=one_queue)
        msg = str(e.value)
        print("\n" + msg)
        assert f"rank 1's data-parallel reduction of chunk {c} (started after action {i - 1}" in msg
        assert "is posted before its bd sum of stage" in msg and "unsummed copy" in msg


def test_one_hardware_queue():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (a post waits for the rank's earlier work, whatever its
    communicator), --overlap-grad-reduce at dp=2, every accepted M up to pp=8. The plan for many
    queues, checked under one: the schedules without bd sums have no cycle; DualPipe's bd sums,
    issued during the schedule on their own communicator, cycle in some cases (a sum holds the rank's
    later P2P until its partner issues it). The plan for one queue (``plan_for(one_queue=True)``,
    what a GPU with that variable gets) issues the sums at the end where they would cycle: no cycle
    in any case, and the cases that keep their mid-schedule sums are counted."""
    for name in sorted(SWEEP):
        cycles, kept, n = [], 0, 0
        for pp, m in _swept(name):
            if pp > FULL_M_UP_TO_PP:
                continue
            for zb in (True, False):
                n += 1
                many = _swept_plan(name, pp, m, zb)
                try:
                    IP.check(many, one_queue=True)
                except IP.IterationPlanError:
                    cycles.append((pp, m, zb))
                one = _check(name, pp, m, zb, one_queue=True)  # raises on a cycle
                kept += one.program.sum_points == many.program.sum_points and any(many.program.sum_points)
        print(f"\n{name}: {len(cycles)} of {n} (pp, M, zero bubble) plans for many queues cycle on one: {cycles[:8]}"
              f"{' ...' if len(cycles) > 8 else ''}; planned for one queue: 0 cycles, {kept} keep their "
              f"mid-schedule bd sums")
        assert n > 0
        if registry.get(name).layout(2).kind != "bidirectional":
            assert not cycles

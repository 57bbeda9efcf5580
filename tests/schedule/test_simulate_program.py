"""The simulator walks the program (``schedule.lowering``, what the runner executes); here
it is proven equal to the action-level simulator it replaced, kept below as the reference: for
every schedule of the registry, several pp and M, padded, under several costs, the same per-action
start and end, busy time, bubble and peaks."""
import heapq

import pytest

from megatron_dualpipe.schedule import build_schedule
from megatron_dualpipe.schedule.actions import BW, F, Action, units
from megatron_dualpipe.schedule.deps import event_of, waits_for
from megatron_dualpipe.schedule.layout import UNIDIRECTIONAL, Layout
from megatron_dualpipe.schedule import registry
from megatron_dualpipe.schedule.padding import Padded, build_padded
from megatron_dualpipe.schedule.lowering import DELEGATED
from megatron_dualpipe.schedule.lowering.program import ProgramOptions, build_program
from megatron_dualpipe.schedule.registry import MODELLED_SPECS, NAMES, ScheduleError
from megatron_dualpipe.schedule.simulate import (Costs, DeadlockError, RankTimeline, _count_memory, simulate,
                                                 simulate_program)

COSTS = (Costs(), Costs(1, 2, 1, 2.5), Costs(2, 3, 0.5, 4, p2p=0.3), Costs(1, 1, 1, 0.5, 1), Costs(1.5, 2.5, 0))


def reference(layout, ranks, costs, p2p=None, overhead=0.0):
    """The action-level simulator before the lowered program (a unit starts when its rank is free and
    every event it waits for has ended, plus ``p2p`` from another rank): its timelines and makespan."""
    hop = p2p or (lambda src, dst: costs.p2p)
    plans = [units(acts) for acts in ranks]
    pos, free_at, done, live, wstate = [0] * len(ranks), [0.0] * len(ranks), {}, [0] * len(ranks), [0] * len(ranks)
    timelines = [RankTimeline(starts=[0.0] * len(a), ends=[0.0] * len(a)) for a in ranks]
    ready, waiting = [], {}

    def examine(r):
        if pos[r] >= len(plans[r]):
            return
        unit, start = plans[r][pos[r]], free_at[r]
        for i in unit:
            for e in waits_for(layout, ranks[r][i]):
                if e in done:
                    t, er = done[e]
                    start = max(start, t + (hop(er, r) if er != r else 0.0))
                elif not any(event_of(ranks[r][j]) == e for j in unit if j < i):
                    waiting.setdefault(e, []).append(r)
                    return
        heapq.heappush(ready, (start, r))

    for r in range(len(ranks)):
        examine(r)
    while ready:
        start, r = heapq.heappop(ready)
        unit = plans[r][pos[r]]
        cost = costs.unit([ranks[r][i] for i in unit]) + overhead
        woken = []
        for i in unit:
            a = ranks[r][i]
            timelines[r].starts[i], timelines[r].ends[i] = start, start + cost
            done[event_of(a)] = (start + cost, r)
            woken.extend(waiting.pop(event_of(a), ()))
            if costs.holds_memory(a):
                _count_memory(timelines[r], a, live, wstate, r)
        timelines[r].busy += cost
        free_at[r], pos[r] = start + cost, pos[r] + 1
        for w in [r] + [w for w in woken if w != r]:
            examine(w)
    assert all(pos[r] == len(plans[r]) for r in range(len(ranks))), "the reference deadlocked"
    return max(free_at, default=0.0), timelines


def _same(res, ref):
    makespan, timelines = ref
    assert res.makespan == makespan
    for got, want in zip(res.ranks, timelines):
        assert (got.starts, got.ends, got.busy) == (want.starts, want.ends, want.busy)
        assert (got.peak_activations, got.peak_weight_grad_states) == \
            (want.peak_activations, want.peak_weight_grad_states)


def _cases(name):
    """(pp, :class:`Padded`) for full and padded batches of ``name`` where it builds (the simulated-only
    schedules unpadded)."""
    spec = registry.spec(name)
    for pp in (1, 2, 3, 4, 6, 8):
        if spec.pp_problem(pp):
            continue
        for real in sorted({spec.min_real_microbatches(pp), pp + 1, 2 * pp, 2 * pp + 1, 3 * pp + 2}):
            try:
                padded = build_padded(name, pp, real) if name in NAMES else \
                    Padded(build_schedule(name, pp, real), real)
            except (ScheduleError, ValueError):
                continue
            yield pp, padded


@pytest.mark.parametrize("name", NAMES + tuple(MODELLED_SPECS))
def test_program_walk_equals_the_action_simulator(name):
    n, padded_n = 0, 0
    for pp, padded in _cases(name):
        s = padded.schedule
        for costs in COSTS:
            wrapped = padded.costs(costs)
            _same(simulate(s.layout, s.ranks, wrapped), reference(s.layout, s.ranks, wrapped))
            n += 1
            padded_n += padded.fake_count > 0
    assert n and (padded_n or name not in ("dualpipe", "dualpipev"))
    print(f"\n{name}: {n} (pp, M, costs) cases equal to the action simulator, {padded_n} of them padded")


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev", "zb-h1"])
def test_per_pair_links_and_overhead_equal(name):
    s = build_schedule(name, 4, 16)
    link = lambda src, dst: 0.1 * (1 + abs(src - dst))  # noqa: E731
    for costs in COSTS:
        _same(simulate(s.layout, s.ranks, costs, p2p=link, overhead=0.25),
              reference(s.layout, s.ranks, costs, p2p=link, overhead=0.25))


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev", "1f1b"])
def test_the_whole_program_with_its_collectives_times_the_same(name):
    """The collectives around the schedule (the program's gathers, sums, reductions, loss gather and
    finalize) are walked in the program's order and cost nothing yet: the timelines equal those of
    the schedule alone."""
    padded = build_padded(name, 4, 10)
    s, costs = padded.schedule, padded.costs(Costs(1, 2, 1, 2.5, p2p=0.2))
    options = ProgramOptions(overlap_grad_reduce=True, dp=2, param_gather=True)
    prog = build_program(name, 4, s.microbatches, 10, options=options)
    assert all(any(op.kind in DELEGATED for op in ops) for ops in prog.ops)
    _same(simulate_program(prog, costs), reference(s.layout, s.ranks, costs))


def test_a_misordered_rank_deadlocks_naming_it():
    """A backward before its own forward on one rank: the communication is fine, the rank's own
    state never comes."""
    layout = Layout(UNIDIRECTIONAL, 1)
    with pytest.raises(DeadlockError, match=r"rank 0 action 0 BW0.0 waits for F0.0 \(stage 0, rank 0\)"):
        simulate(layout, [[Action(BW, 0, 0, 0), Action(F, 0, 0, 0)]], Costs())

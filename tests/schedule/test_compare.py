"""The event-driven simulator against a brute-force reference, padded runs as the executor runs them,
and the same-model comparison of schedules."""
import pytest

from megatron_dualpipe.schedule import build_schedule
from megatron_dualpipe.schedule.actions import F
from megatron_dualpipe.costs.compare import compare, parameter_copies
from megatron_dualpipe.schedule.padding import build_padded
from megatron_dualpipe.schedule.deps import event_of, waits_for
from megatron_dualpipe.schedule.registry import DUALPIPE, DUALPIPEV, NAMES, ONE_F_ONE_B, ZB_H1, get
from megatron_dualpipe.schedule.simulate import Costs, simulate, units


def reference_times(layout, ranks, costs):
    """Brute force: at every step scan all ranks and run the ready unit that starts earliest
    (lowest rank on ties). Returns per-rank (start, end) lists."""
    plans = [units(a) for a in ranks]
    pos, free, done = [0] * len(ranks), [0.0] * len(ranks), {}
    times = [[None] * len(a) for a in ranks]
    while any(pos[r] < len(plans[r]) for r in range(len(ranks))):
        best = None
        for r in range(len(ranks)):
            if pos[r] == len(plans[r]):
                continue
            unit, start, ready = plans[r][pos[r]], free[r], True
            own = {event_of(ranks[r][i]) for i in unit}
            for i in unit:
                for e in waits_for(layout, ranks[r][i]):
                    if e in done:
                        t, er = done[e]
                        start = max(start, t + (costs.p2p if er != r else 0))
                    elif e not in own:
                        ready = False
            if ready and (best is None or start < best[0]):
                best = (start, r)
        start, r = best
        unit = plans[r][pos[r]]
        end = start + costs.unit([ranks[r][i] for i in unit])
        for i in unit:
            times[r][i] = (start, end)
            done[event_of(ranks[r][i])] = (end, r)
        free[r], pos[r] = end, pos[r] + 1
    return times


@pytest.mark.parametrize("name", NAMES)
def test_event_driven_simulator_equals_the_brute_force_reference(name):
    n = 0
    for pp in (1, 2, 3, 4, 6):
        for m in (pp, 2 * pp, 2 * pp + 1, 3 * pp + 2):
            try:
                s = build_schedule(name, pp, m)
            except ValueError:
                continue
            for costs in (Costs(), Costs(1, 2, 1, 2.5), Costs(2, 3, 0.5, 4, p2p=0.3), Costs(1, 1, 1, 0.5, 1)):
                res = simulate(s.layout, s.ranks, costs)
                ref = reference_times(s.layout, s.ranks, costs)
                assert [list(zip(t.starts, t.ends)) for t in res.ranks] == ref, (name, pp, m, costs)
                n += 1
    print(f"\n{name}: {n} (pp, M, costs) cases identical to the brute-force scan")


@pytest.mark.parametrize("name", [DUALPIPE, DUALPIPEV, ZB_H1])
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_padded_runs_cost_only_the_real_microbatches(name, pp):
    """Fakes compute nothing: with fb = f + b every rank's busy time is the real work alone, and no rank
    holds more live activations than it has real micro-batches."""
    spec = get(name)
    costs = Costs(f=1, b=3, w=1)
    for real in range(spec.min_real_microbatches(pp), 2 * pp + 2):
        padded = build_padded(name, pp, real)
        s = padded.schedule
        res = simulate(s.layout, s.ranks, padded.costs(costs))
        chunks = spec.model_stages(pp) // pp  # chunks each micro-batch passes on a rank
        for t in res.ranks:
            assert t.busy == pytest.approx(real * chunks * (costs.f + costs.b)), (name, pp, real)
            assert t.peak_activations <= real * chunks


def test_padding_lowers_the_peak_below_a_full_pipeline():
    padded = build_padded(DUALPIPE, 8, 8)  # runs as 16, half of them fake
    s = padded.schedule
    full = max(simulate(s.layout, s.ranks, Costs()).peak_activations)
    real = max(simulate(s.layout, s.ranks, padded.costs(Costs())).peak_activations)
    print(f"\ndualpipe pp=8, 8 real of 16: peak activations {real} (all 16 real: {full})")
    assert (s.microbatches, full) == (16, 9) and real <= 8


def test_same_model_costs_dualpipev_chunks_at_half_a_stage():
    stage = Costs(f=2, b=4, w=2, fb=6)
    rows = {r.name: r for r in compare(4, 16, stage)}
    assert rows[DUALPIPEV].costs == Costs(1, 2, 1, 3) and rows[DUALPIPE].costs == stage
    # Closed forms at each schedule's own costs (DeepSeek's table; exact at f = w = b/2).
    assert rows[ONE_F_ONE_B].bubble == 3 * (2 + 4) == 18
    assert rows[ZB_H1].bubble == 3 * (2 + 4 - 4) == 6
    assert rows[DUALPIPE].bubble == (4 / 2 - 1) * (6 + 4 - 6) == 4
    assert rows[DUALPIPEV].bubble == (4 - 1) * (3 + 2 - 3) == 6
    # Busy time is the same model's work on every schedule: M x (f + b) per rank.
    for r in rows.values():
        assert r.makespan - r.bubble == pytest.approx(16 * (2 + 4))
    assert [rows[n].parameter_copies for n in (ONE_F_ONE_B, ZB_H1, DUALPIPE, DUALPIPEV)] == [1, 1, 2, 1]
    assert [rows[n].peak_activations for n in (ONE_F_ONE_B, DUALPIPE, DUALPIPEV)] == [4, 5, 4.5]
    assert parameter_copies(get(DUALPIPE), 4) == 2


def test_a_schedule_that_cannot_run_says_why():
    rows = {r.name: r for r in compare(3, 8, Costs())}
    assert rows[DUALPIPE].problem and "even" in rows[DUALPIPE].problem
    assert rows[DUALPIPEV].problem is None and rows[DUALPIPEV].microbatches == 8


def test_counted_forwards_match_model_stages_times_microbatches():
    """The CLI's size limit counts M x model stages forward actions: check it against the built lists."""
    for name in NAMES:
        spec = get(name)
        for pp in (2, 4):
            m = spec.padded_microbatches(pp, 2 * pp + 1)
            s = build_schedule(name, pp, m)
            assert sum(a.op == F for acts in s.ranks for a in acts) == spec.model_stages(pp) * m

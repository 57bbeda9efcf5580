"""Simulated bubbles against the closed forms, with hypothetical costs only (no timing).

Closed forms (DeepSeek's DualPipe table and the Zero Bubble paper), bubble = makespan - busy,
maximum over ranks:

* 1F1B      (pp-1)(f+b)
* ZB-H1     (pp-1)(f+b-2w)
* DualPipe  (pp/2-1)(fb+b-3w)
* DualPipeV (S/2-1)(fb+b-3w), S = 2*pp chunk stages, costs per chunk: (pp-1)(fb+b-3w)

Run with ``pytest -q -s tests/schedule/test_simulate.py`` to see the tables of the settings where the
simulator and the closed forms differ.
"""
import pytest

from megatron_dualpipe.schedule import build_schedule, get
from megatron_dualpipe.schedule.actions import BW, F, Action
from megatron_dualpipe.schedule.layout import UNIDIRECTIONAL, Layout
from megatron_dualpipe.schedule.simulate import Costs, DeadlockError, simulate


def _bubble(name, pp, m, costs):
    s = build_schedule(name, pp, m)
    return max(simulate(s.layout, s.ranks, costs).bubble)


def _table(title, header, rows):
    print(f"\n{title}")
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(x) for x in row))


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6, 8])
def test_1f1b_bubble_is_exact(pp):
    for costs in (Costs(1, 2, 1), Costs(1, 3, 1.5), Costs(2, 2, 0.5), Costs(1.5, 2.5, 0)):
        for m in (pp, pp + 1, 2 * pp, 3 * pp + 1):
            assert _bubble("1f1b", pp, m, costs) == pytest.approx((pp - 1) * (costs.f + costs.b))


# ZB-H1 is exact when W fits in the gaps it is meant to fill: w <= f and w <= b - w (the
# input-only backward is no cheaper than W). Otherwise the simulated bubble is larger by
# (pp-1)(w - min(f, b-w)); see test_zb_h1_outside_its_assumptions.
ZB_EXACT = [Costs(1, 2, 1), Costs(1, 2, 0.5), Costs(1, 2, 0), Costs(2, 3, 1.5), Costs(1, 3, 1), Costs(2, 4, 2)]
ZB_OFF = [Costs(1, 3, 1.5), Costs(1, 2, 1.5), Costs(2, 2, 1.5), Costs(1, 1, 1), Costs(1, 4, 2)]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6, 8])
def test_zb_h1_bubble_is_exact_when_w_fits(pp):
    for costs in ZB_EXACT:
        assert costs.w <= costs.f and costs.w <= costs.b - costs.w
        for m in (pp, pp + 1, 2 * pp, 3 * pp + 1):
            want = (pp - 1) * (costs.f + costs.b - 2 * costs.w)
            assert _bubble("zb-h1", pp, m, costs) == pytest.approx(want), (costs, m)


def test_zb_h1_outside_its_assumptions():
    rows = []
    for costs in ZB_OFF:
        for pp in (2, 4, 8):
            sim = _bubble("zb-h1", pp, 2 * pp, costs)
            form = (pp - 1) * (costs.f + costs.b - 2 * costs.w)
            rows.append((costs.f, costs.b, costs.w, pp, sim, form, sim - form))
            assert sim - form == pytest.approx((pp - 1) * (costs.w - min(costs.f, costs.b - costs.w)))
    _table("ZB-H1 where w > f or w > b-w (simulated - formula = (pp-1)(w - min(f, b-w)))",
           ["f", "b", "w", "pp", "simulated", "formula", "diff"], rows)


# DualPipe/DualPipeV: exact at DeepSeek's setting f = w = b/2 with no overlap gain (fb = f+b),
# and also (found here) with fb = 2.5 at f=1, b=2, w=1.
DP_EXACT = [Costs(1, 2, 1, 3), Costs(1, 2, 1), Costs(2, 4, 2, 6), Costs(1, 2, 1, 2.5)]
DP_OTHER = [Costs(1, 2, 0.5, 2.5), Costs(1, 2, 0.5, 3), Costs(1, 2, 0, 3), Costs(1, 3, 1, 4),
            Costs(1, 2, 1, 4), Costs(1, 2, 1.5, 3), Costs(2, 2, 1, 4)]


@pytest.mark.parametrize("pp", [2, 4, 6, 8, 12, 16])
def test_dualpipe_bubble_is_exact_at_deepseeks_costs(pp):
    for costs in DP_EXACT:
        for m in (2 * pp, 2 * pp + 2, 3 * pp):
            want = (pp / 2 - 1) * (costs.fused + costs.b - 3 * costs.w)
            assert _bubble("dualpipe", pp, m, costs) == pytest.approx(want), (costs, m)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6, 8])
def test_dualpipev_bubble_is_exact_in_chunk_costs(pp):
    for costs in DP_EXACT:
        for m in (2 * pp, 2 * pp + 1, 3 * pp):
            s_stages = 2 * pp
            want = (s_stages / 2 - 1) * (costs.fused + costs.b - 3 * costs.w)
            assert _bubble("dualpipev", pp, m, costs) == pytest.approx(want), (costs, m)
            assert want == pytest.approx(get("dualpipev").formula_bubble(pp, costs))


def test_dualpipe_and_dualpipev_other_costs_table():
    rows = []
    for costs in DP_OTHER:
        for name, pp in (("dualpipe", 4), ("dualpipe", 8), ("dualpipe", 16), ("dualpipev", 4), ("dualpipev", 8)):
            sim = _bubble(name, pp, 2 * pp, costs)
            form = get(name).formula_bubble(pp, costs)
            rows.append((name, costs.f, costs.b, costs.w, costs.fused, pp, sim, form, sim - form))
            # The bubble does not depend on M once the schedule is full.
            assert _bubble(name, pp, 2 * pp + 2, costs) == pytest.approx(sim)
    _table("DualPipe / DualPipeV bubble outside f = w = b/2 (max over ranks)",
           ["schedule", "f", "b", "w", "fb", "pp", "simulated", "formula", "diff"], rows)


def test_dualpipev_is_half_of_dualpipe():
    """DualPipeV on pp ranks times like ranks 0..pp-1 of DualPipe on 2*pp ranks (DeepSeek's
    'cut-in-half' DualPipe), in the same per-stage (per-chunk) costs."""
    for costs in DP_EXACT + DP_OTHER:
        for pp, m in ((2, 4), (2, 5), (4, 9), (4, 12)):
            # DualPipe's M counts both directions: M per direction of DualPipeV = M/2 of DualPipe.
            a = build_schedule("dualpipev", pp, m)
            b = build_schedule("dualpipe", 2 * pp, 2 * m)
            ra, rb = simulate(a.layout, a.ranks, costs), simulate(b.layout, b.ranks, costs)
            assert ra.makespan == pytest.approx(rb.makespan)
            assert ra.bubble == pytest.approx(rb.bubble[:pp])


def test_deadlock_names_rank_and_awaited_action():
    layout = Layout(UNIDIRECTIONAL, 2)
    # Rank 0 runs the backward of micro-batch 0 before its forward; rank 1 waits for that
    # forward before it can produce the gradient rank 0 waits for.
    ranks = [
        [Action(BW, 0, 0, 0), Action(F, 0, 0, 0)],
        [Action(F, 0, 0, 1), Action(BW, 0, 0, 1)],
    ]
    with pytest.raises(DeadlockError) as e:
        simulate(layout, ranks, Costs())
    msg = str(e.value)
    assert "rank 0 action 0 BW0.0 waits for" in msg
    assert "B0.0 (stage 1, rank 1)" in msg
    assert "rank 1 action 0 F0.0 waits for F0.0 (stage 0, rank 0)" in msg
    assert "[BW0.0]" in msg  # the grid marks the first stuck action


@pytest.mark.parametrize("name,pp,m", [("1f1b", 4, 8), ("zb-h1", 4, 8), ("dualpipe", 4, 8), ("dualpipev", 4, 8)])
def test_p2p_latency_increases_makespan(name, pp, m):
    s = build_schedule(name, pp, m)
    base = simulate(s.layout, s.ranks, Costs(1, 2, 1, 3)).makespan
    slow = simulate(s.layout, s.ranks, Costs(1, 2, 1, 3, p2p=0.5)).makespan
    slower = simulate(s.layout, s.ranks, Costs(1, 2, 1, 3, p2p=1.0)).makespan
    assert base < slow < slower


def test_p2p_latency_on_one_rank_costs_nothing():
    s = build_schedule("1f1b", 1, 4)
    assert simulate(s.layout, s.ranks, Costs(p2p=5)).makespan == simulate(s.layout, s.ranks, Costs()).makespan


@pytest.mark.parametrize("pp", [1, 2, 4, 7, 8])
def test_1f1b_peak_activations(pp):
    for name in ("1f1b", "zb-h1"):
        for m in (pp, 2 * pp + 1):
            s = build_schedule(name, pp, m)
            res = simulate(s.layout, s.ranks, Costs())
            assert res.peak_activations == [pp - r for r in range(pp)]


def test_dualpipe_peak_activations_match_deepseeks_table():
    # DeepSeek: DualPipe keeps pp+1 micro-batch activations (of one stage) on a rank. In
    # DualPipeV a rank holds 2pp+1 chunk activations, i.e. pp + 1/2 stages' worth.
    for pp in (2, 4, 8, 16):
        s = build_schedule("dualpipe", pp, 2 * pp + 2)
        assert max(simulate(s.layout, s.ranks, Costs()).peak_activations) == pp + 1
    for pp in (1, 2, 3, 4, 8):
        s = build_schedule("dualpipev", pp, 2 * pp + 2)
        assert max(simulate(s.layout, s.ranks, Costs()).peak_activations) == 2 * pp + 1


def test_costs_validation():
    for kwargs, needle in (({"f": -1}, "--f"), ({"b": 1, "w": 2}, "cannot exceed"),
                           ({"p2p": -0.5}, "--p2p"), ({"fb": -1}, "--fb")):
        with pytest.raises(ValueError, match=needle):
            Costs(**kwargs)


def test_overlap_section_of_the_bubble_report():
    """tools/bubble_report.py's overlap table: every rank's busy time is its actions' costs minus
    what each fused unit saves (``f + b - fb``), counted here from the action lists; the makespan
    is busy time plus bubble; 1F1B (no fused units) does not change with r."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bubble_report.py"
    spec = importlib.util.spec_from_file_location("bubble_report", path)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    assert report.fused_cost(Costs(1, 2, 1), 0.5) == 2.5 and report.fused_cost(Costs(3, 2, 1), 1) == 3
    rows, table_rows = [], list(report.overlap_rows())
    for r in report.OVERLAP_RATIOS:
        fb = report.fused_cost(report.STAGE, r)
        for name in report.OVERLAP_SCHEDULES:
            pp = 8
            spec = get(name)
            k = pp / spec.model_stages(pp)  # DualPipeV's chunks are half a stage
            costs = Costs(f=k * report.STAGE.f, b=k * report.STAGE.b, w=k * report.STAGE.w, fb=k * fb)
            s = build_schedule(name, pp, 4 * pp)
            res = simulate(s.layout, s.ranks, costs)
            for rank, acts in enumerate(s.ranks):
                fused = sum(1 for a in acts if a.overlap)
                want = sum(costs.of(a) for a in acts) - fused * (costs.f + costs.b - costs.fused)
                assert res.busy[rank] == pytest.approx(want), (r, name, rank)
                assert res.makespan == pytest.approx(res.busy[rank] + res.bubble[rank])
            table = {row[3].name: row[3] for row in table_rows if row[0] == r and row[2] == pp}
            assert table[name].makespan == pytest.approx(res.makespan) and table[name].bubble == max(res.bubble)
            rows.append((r, name, res.makespan, max(res.bubble)))
    by = {(r, n): mk for r, n, mk, _ in rows}
    assert by[(0.0, "1f1b")] == by[(1.0, "1f1b")]
    assert by[(1.0, "dualpipe")] < by[(0.5, "dualpipe")] < by[(0.0, "dualpipe")]
    _table("overlap ratio r -> makespan at pp=8, M=32 (per-stage f=1 b=2 w=1)",
           ["r", "schedule", "makespan", "bubble"], rows)

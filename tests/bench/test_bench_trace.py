"""``megatron-dualpipe bench`` and ``megatron-dualpipe trace`` end to end, on tiny costs.

No figure is asserted (speed is what the benchmark prints, not what a test checks): the bench
must run the project's schedules and torch's on gloo processes and report, per schedule, the
simulator's makespan for the same costs and the simulator's peak activations next to the
counted ones; the recorded timed iterations must turn into a Perfetto trace holding every
execution unit of every rank, and into the stacked PNG.
"""
import json

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.schedule import build_schedule
from megatron_dualpipe.schedule.actions import units
from megatron_dualpipe.schedule.simulate import Costs, simulate

PP, M = 2, 4


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    import contextlib
    import io

    trace_dir = tmp_path_factory.mktemp("trace")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "--pp", str(PP), "-m", "2pp", "--f", "2", "--b", "4", "--w", "2", "--iters", "1",
                     "--warmup", "0", "--schedule", "executor-1f1b", "dualpipe", "dualpipev", "--peer", "torch",
                     "--grad-mb", "1", "--json", "--trace", str(trace_dir)])
    assert code == 0
    return json.loads(out.getvalue()), trace_dir


def test_bench_reports_every_schedule_against_the_simulator(bench_run):
    doc, _ = bench_run
    rows = {(r["runner"], r["schedule"]): r for r in doc["rows"]}
    print("\n" + "\n".join(f"{k}: {v['median_ms']:.1f} ms, sim {v['sim_ms']}, x{v['ratio']}" for k, v in rows.items()))
    assert set(rows) == {("project", "executor-1f1b"), ("project", "dualpipe"), ("project", "dualpipev"),
                         ("torch", "torch-1f1b"), ("torch", "torch-dualpipev"), ("torch", "torch-zbv"),
                         ("torch", "torch-interleaved")}
    # torch's interleaved 1F1B is timed against the simulation of Megatron's interleaved order, same chunk costs
    s = build_schedule("interleaved-1f1b", PP, M)
    assert rows[("torch", "torch-interleaved")]["sim_ms"] == pytest.approx(
        simulate(s.layout, s.ranks, Costs(f=2, b=4, w=2)).makespan)
    for name in ("executor-1f1b", "dualpipe", "dualpipev"):
        s = build_schedule(name, PP, M)
        sim = simulate(s.layout, s.ranks, Costs(f=2, b=4, w=2))
        row = rows[("project", name)]
        assert row["sim_ms"] == pytest.approx(sim.makespan)
        assert row["sim_peak_activations"] == sim.peak_activations
        assert row["peak_activations"] == sim.peak_activations  # the executor runs the plan's order
        assert row["median_ms"] > 0 and len(row["p2p_ms"]) == PP
    # --grad-mb: only DualPipe has two copies of a stage to sum; every rank reports what showed.
    summed = {k for k, r in rows.items() if r.get("bd_exposed_ms")}
    print("bd sums exposed/alone ms:", rows[("project", "dualpipe")]["bd_exposed_ms"],
          rows[("project", "dualpipe")]["bd_alone_ms"])
    assert summed == {("project", "dualpipe")}
    assert len(rows[("project", "dualpipe")]["bd_exposed_ms"]) == PP
    assert all(t > 0 for t in rows[("project", "dualpipe")]["bd_alone_ms"])
    pairs = {(p["project"], p["torch"]) for p in doc["project_over_torch"]}
    assert pairs == {("executor-1f1b", "torch-1f1b"), ("dualpipev", "torch-dualpipev"), ("dualpipev", "torch-zbv")}
    assert doc["p2p_latency_ms"][str(PP)] > 0
    # The prediction from the probes: makespan with the probed latency and per-unit cost, plus (DualPipe
    # only: the others have no copies to sum and dp=1) the bd sums past the end of the schedule.
    lat = doc["p2p_latency_ms"][str(PP)]
    for name in ("executor-1f1b", "dualpipe", "dualpipev"):
        row = rows[("project", name)]
        s = build_schedule(name, PP, M)
        bare = simulate(s.layout, s.ranks, Costs(f=2, b=4, w=2, p2p=lat), overhead=row["unit_overhead_ms"]).makespan
        print(f"{name}: predicted {row['predicted_ms']:.1f} ms (without gradients {bare:.1f}), measured "
              f"{row['median_ms']:.1f}, x pred {row['ratio_predicted']:.3f}")
        if name == "dualpipe":
            assert row["bd_probe_ms"] > 0 and row["predicted_ms"] > bare
        else:
            assert row["predicted_ms"] == pytest.approx(bare)


def test_trace_of_a_recorded_run(bench_run, tmp_path, capsys):
    _, trace_dir = bench_run
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    code = main(["trace", str(trace_dir / f"dualpipe_pp{PP}_m{M}"), "--png", str(png), "--json", str(trace)])
    out, err = capsys.readouterr()
    print(f"\n{out}")
    assert code == 0, err
    assert png.stat().st_size > 1000
    events = json.load(open(trace))["traceEvents"]
    s = build_schedule("dualpipe", PP, M)
    for pid in (0, 1):  # measured, simulated
        slices = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["name"] != "wait"]
        assert len(slices) == sum(len(units(acts)) for acts in s.ranks)
        for r in range(PP):
            mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if e["tid"] == r)
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(mine, mine[1:])), "a rank runs one unit at a time"
    assert "measured" in out and "simulated" in out


def test_trace_of_an_empty_directory_names_the_fix(tmp_path, capsys):
    assert main(["trace", str(tmp_path)]) == 2
    assert "MEGATRON_DUALPIPE_TRACE=" in capsys.readouterr().err

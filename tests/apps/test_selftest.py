"""``megatron-dualpipe selftest`` on this CPU machine: the short form CI runs end to end, and a broken
executor that the selftest must catch.

* The quick run (4 processes as pp=2 x ep=2, gloo, CPU mode) passes every stage that can run here,
  skips the GPU-only one with its reason (after recording what it can), and writes the report, the
  JSON and the timelines.
* With the test-only fault (``MEGATRON_DUALPIPE_SELFTEST_FAULT=swap-microbatch``: the last pipeline
  rank reads micro-batches 0 and 1 in swapped order under DualPipe) the equality stage FAILs with
  the loss of micro-batch 0 against Megatron 1F1B's, the selftest stops there and exits 1.
* With ``wrong-gradient`` (one router gradient of DualPipeV 0.1% off) the deepseek-v3 stage FAILs
  naming that gradient and its relative difference.
* Bad settings end in one line naming the fix, before any process starts.

``pytest -s`` prints the report of each run.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from megatron_dualpipe.cli import main
from megatron_dualpipe.selftest import faults
from megatron_dualpipe.selftest.options import TOLERANCE

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of the selftest")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _selftest(out: pathlib.Path, *flags: str, env=None, timeout: float = 900):
    """Run the command as a user does; return (exit status, output, the JSON report)."""
    environ = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "megatron_dualpipe", "selftest", "--quick", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=timeout, env=environ, cwd=ROOT)
    report = json.loads((out / "selftest.json").read_text())
    print(f"\n$ megatron-dualpipe selftest --quick {' '.join(flags)}  -> exit {proc.returncode}")
    print((out / "selftest.md").read_text())
    return proc.returncode, proc.stdout, report


def _stage(report, name):
    found = [s for s in report["stages"] if s["stage"] == name]
    assert found, f"stage {name!r} missing from {[s['stage'] for s in report['stages']]}"
    return found[0]


def test_quick_cpu_run_passes_end_to_end(tmp_path):
    """4 processes as pp=2 x ep=2: the dense GPT and the MoE over expert parallelism (fused F&B units
    through the combined step) in one run, so that every stage runs here."""
    code, stdout, report = _selftest(tmp_path, "--nproc", "4", "--ep", "2", "--deadline", "10")
    statuses = {s["stage"]: s["status"] for s in report["stages"]}
    assert code == 0 and not report["failed"], stdout
    assert statuses == {"environment": "PASS", "equality": "PASS", "deepseek-v3": "PASS",
                        "no hang (odd M, pp <= M < 2pp)": "PASS", "overlap": "SKIP", "speed": "PASS", "memory": "PASS",
                        "no hang (a rank raises)": "PASS"}
    for s in report["stages"]:
        assert f"[{s['status']}] {s['stage']}: " in stdout  # one line per stage as it ends
    # equality: the numbers behind the PASS are within the stated tolerance, and were compared at all
    for model in ("GPT", "MoE"):
        eq = _stage(report, "equality")["numbers"][model]
        for schedule in ("dualpipe", "dualpipev"):
            assert 0 <= eq[schedule]["max_rel_grad_diff"] <= TOLERANCE["fp32"]
            assert 0 <= eq[schedule]["max_rel_loss_diff"] <= TOLERANCE["fp32"]
        for schedule in ("1f1b", "dualpipe", "dualpipev"):  # the pp=1 reference the CPU tests use too
            assert 0 <= eq["vs_reference"][schedule]["rel_grad_diff"] <= TOLERANCE["fp32"]
            assert 0 <= eq["vs_reference"][schedule]["rel_loss_diff"] <= TOLERANCE["fp32"]
        assert eq["copies_identical"] is True
    _check_deepseek_v3(_stage(report, "deepseek-v3"))
    # overlap: skipped here, saying why, after its node timer (CUDA events on a GPU, the host clock
    # here) recorded the dispatch and combine of every layer of every fused unit, forward and backward
    overlap = _stage(report, "overlap")
    assert "not measurable on the CPU" in overlap["summary"]
    ranks = overlap["numbers"]["ranks"]
    assert sum(r["units"] for r in ranks) > 0
    for r in ranks:
        assert r["comm_nodes"] > 0 and r["comm_nodes"] % 4 == 0 and r["comm_ms"] > 0
        assert r["hidden_ms"] <= 1e-6 * r["comm_ms"]  # one after another on the CPU
    env = _stage(report, "environment")["numbers"]  # pp=2: one pair of neighbours, one bd pair
    assert len(env["pairs"]) == 1 + 1 and all(p["latency_us"] > 0 and p["bandwidth_gbs"] > 0 for p in env["pairs"])
    speed = _stage(report, "speed")["numbers"]["rows"]
    assert {r["schedule"] for r in speed} == {"executor-1f1b", "zb-h1", "dualpipe", "dualpipev"}
    assert all(r["median_ms"] > 0 and r["sim_ms"] > 0 for r in speed)
    assert all(r["bd_exposed_ms"] for r in speed if r["schedule"] == "dualpipe")  # the bd sums were in
    memory = _stage(report, "memory")["numbers"]
    assert all(memory[s]["measured_max_mib"] > 0 for s in ("1f1b", "dualpipe", "dualpipev"))
    for name in ("dualpipe", "dualpipev", "executor-1f1b", "zb-h1"):
        png, js = tmp_path / f"timeline_{name}_pp4_m8.png", tmp_path / f"timeline_{name}_pp4_m8.json"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert json.loads(js.read_text())["traceEvents"]


def _check_deepseek_v3(v3):
    """The V3-shaped model: every schedule, Megatron's interleaved 1F1B with its all-to-all overlap
    included, within the tolerance of 1F1B, each through the combined step, and its speed measured."""
    numbers = v3["numbers"]
    for schedule in ("dualpipe", "dualpipev", "interleaved-1f1b"):
        assert 0 <= numbers[schedule]["max_rel_grad_diff"] <= TOLERANCE["fp32"]
        assert 0 <= numbers[schedule]["max_rel_loss_diff"] <= TOLERANCE["fp32"]
        assert numbers["combined_step_forwards"][schedule] > 0  # fused units / the all-to-all overlap ran
    speed = numbers["speed"]
    assert set(speed) == {"1f1b", "dualpipe", "dualpipev", "interleaved-1f1b"}
    assert all(s["tokens_per_s"] > 0 and s["peak_bytes"] is None for s in speed.values())
    assert sum("peak memory not measured (CPU)" in line for line in v3["details"]) == 4


def test_a_wrong_gradient_fails_the_deepseek_v3_stage_with_the_number(tmp_path):
    """2 processes (pp=2, no expert parallelism: the V3 model's experts all local, no fused units):
    DualPipeV's gradient of one router weight on pipeline rank 0 made 0.1% too large; the stage FAILs
    with that gradient's relative difference, the scale the fault applied."""
    code, stdout, report = _selftest(tmp_path, "--nproc", "2", env={faults.FAULT_ENV: "wrong-gradient"})
    assert code == 1 and report["failed"]
    assert [s["stage"] for s in report["stages"]] == ["environment", "equality", "deepseek-v3"]
    v3 = _stage(report, "deepseek-v3")
    m = re.search(r"V3 dualpipev: gradient of rank \(pp 0, .*\) model\[\d\] (\S+) differs from 1F1B's by (\S+) "
                  r"\(relative\) >", v3["summary"])
    assert v3["status"] == "FAIL" and m, v3["summary"]
    assert "router" in m.group(1)
    assert float(m.group(2)) == pytest.approx(faults.WRONG_GRADIENT_SCALE - 1, rel=1e-3)
    assert v3["numbers"]["dualpipe"]["max_rel_grad_diff"] <= TOLERANCE["fp32"]  # the others still equal
    assert "[FAIL] deepseek-v3: V3 dualpipev: gradient of" in stdout


def test_a_broken_executor_fails_equality_with_the_number(tmp_path):
    code, stdout, report = _selftest(tmp_path, "--nproc", "2", env={faults.FAULT_ENV: "swap-microbatch"})
    assert code == 1 and report["failed"]
    assert [s["stage"] for s in report["stages"]] == ["environment", "equality"]  # stopped at the hard failure
    eq = _stage(report, "equality")
    assert eq["status"] == "FAIL"
    m = re.search(r"loss of micro-batch 0 \(dp 0\) (\S+) vs 1F1B (\S+): relative difference (\S+) >", eq["summary"])
    assert m, eq["summary"]
    got, want, diff = map(float, m.groups())
    assert diff == pytest.approx(abs(got - want) / abs(want), rel=1e-2) and diff > TOLERANCE["fp32"]
    assert "[FAIL] equality: GPT dualpipe: loss of micro-batch 0" in stdout


#: The TE matrix's combinations the selftest runs with --te (tests/megatron_lm/test_megatron_lm_te.py) ->
#: the tolerance they are held to on the CPU (the flex dispatcher runs bf16: DeepEP combines bf16 only).
TE_MATRIX = {"MTP, zero bubble through TE's delayed wgrad": "fp32",
             "MoE, grouped GEMM, overlapped shared experts, selective recomputation": "fp32",
             "MoE, shared experts, MLA, fused F&B units, MTP, selective recomputation": "fp32",
             "FP8 tensorwise, first and last layers in bf16": "fp32",
             "MoE, flex dispatcher (DeepEP), grouped GEMM, fused F&B units": "bf16"}


def test_quick_cpu_run_with_transformer_engine_layers_passes(tmp_path):
    """``--te --fp8`` without a GPU: the layers are the CPU mode's Transformer Engine stand-in's (FP8 a
    no-op for the numbers, fp32), the dense GPT, the MoE with fused F&B units and the DeepSeek-V3
    shape alike, every schedule's losses and gradients against Megatron's 1F1B on the same layers; and
    the TE matrix's combinations (grouped GEMM and DeepEP through their stand-ins, zero bubble through
    TE's deferral), one result line each with its largest difference."""
    code, stdout, report = _selftest(tmp_path, "--nproc", "4", "--ep", "2", "--te", "--fp8", "--deadline", "10")
    statuses = {s["stage"]: s["status"] for s in report["stages"]}
    assert code == 0 and not report["failed"], stdout
    assert statuses["equality"] == statuses["deepseek-v3"] == "PASS", statuses
    for model in ("GPT", "MoE"):
        eq = _stage(report, "equality")["numbers"][model]
        for schedule in ("dualpipe", "dualpipev"):
            assert 0 <= eq[schedule]["max_rel_grad_diff"] <= TOLERANCE["fp32"]
    _check_deepseek_v3(_stage(report, "deepseek-v3"))
    matrix = _stage(report, "equality")["numbers"]["te_matrix"]
    for prefix, dtype in TE_MATRIX.items():
        [name] = [n for n in matrix if n.startswith(prefix)]
        line = next(line for line in stdout.splitlines() if line.startswith(f"    [PASS] {name}: "))
        assert re.search(r"dualpipe loss \S+ grad \S+, dualpipev loss \S+ grad \S+", line), line
        for schedule in ("dualpipe", "dualpipev"):
            assert 0 <= matrix[name][schedule]["max_rel_grad_diff"] <= TOLERANCE[dtype], (name, matrix[name])
            assert 0 <= matrix[name][schedule]["max_rel_loss_diff"] <= TOLERANCE[dtype], (name, matrix[name])
            assert matrix[name][schedule]["gradients_of_1f1b_compared"] > 0
    assert len(matrix) == len(TE_MATRIX)


def test_transformer_engine_combinations_say_what_they_need():
    """What a combination needs that the run lacks is its SKIP reason, naming the flag that runs it:
    expert parallelism (--ep 2), FP8 (--fp8); on a GPU, DeepEP installed."""
    from megatron_dualpipe.selftest import te_matrix
    from megatron_dualpipe.selftest.options import SelftestConfig

    def why(**settings):
        return {name[:12]: reason for name, _, reason in te_matrix.combinations(SelftestConfig(**settings))}

    plain = why(world=2, te=True)
    print("\n" + "\n".join(f"{name}: {reason}" for name, reason in plain.items()))
    assert plain["MTP, zero bu"] is None
    assert all("run with --ep 2" in plain[name] for name in plain if name.startswith("MoE"))
    assert "run with --fp8" in plain["FP8 tensorwi"]
    full = why(world=4, ep=2, te=True, fp8=True)
    assert importlib.util.find_spec("deep_ep") is None  # this process has no stand-ins: as a GPU without DeepEP
    assert "DeepEP is not installed" in full.pop("MoE, flex di")
    assert all(reason is None for reason in full.values()), full


BAD = [
    (["--nproc", "3"], "use --nproc 4"),
    (["--nproc", "1"], "at least 2 processes"),
    (["--nproc", "4", "--tp", "3"], "multiple of 3"),
    (["--nproc", "4", "--fp8"], "add --te"),
    (["--nproc", "4", "--deadline", "0"], "--deadline"),
    (["--nproc", "4", "--model-hidden", "0"], "--model-hidden"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_settings_are_one_line_before_anything_starts(capsys, tmp_path, argv, needle):
    code = main(["selftest", *argv, "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    print(f"\nselftest {' '.join(argv)} -> {code}: {err.strip()}")
    assert code == 2 and err.count("\n") == 1 and needle in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_hidden_fraction_arithmetic():
    from megatron_dualpipe.selftest.overlap import hidden_ms

    compute = [(0.0, 4.0), (3.0, 6.0), (10.0, 12.0)]  # union: [0, 6] and [10, 12]
    assert hidden_ms([(5.0, 11.0)], compute) == (2.0, 6.0)  # 5-6 and 10-11 inside
    assert hidden_ms([(6.0, 10.0)], compute) == (0.0, 4.0)  # in the gap: nothing hidden
    assert hidden_ms([(1.0, 2.0), (10.5, 11.5)], compute) == (2.0, 2.0)
    assert hidden_ms([], compute) == (0.0, 0.0)


def test_a_rank_stuck_in_a_stage_is_stopped_by_the_watchdog_naming_it(tmp_path):
    """Rank 1 never ends the first stage (the test-only fault ``stall:environment``), where no
    point-to-point timeout of its own applies: within the stage limit (30 x --deadline) the selftest
    exits 1, rank 1 says on stderr which stage it was in and where its threads were, and the parent
    names the ranks that died without a result. Before the watchdog the others waited in their next
    collective for the process group's timeout (an hour), silently."""
    deadline = 0.1  # the stall is in the first stage and never ends: nothing else has to fit in the limit
    limit = 30 * deadline
    environ = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **{faults.FAULT_ENV: "stall:environment"})
    cmd = [sys.executable, "-m", "megatron_dualpipe", "selftest", "--quick", "--out", str(tmp_path), "--nproc", "2",
           "--deadline", f"{deadline:g}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit + 600, env=environ, cwd=ROOT)
    stuck = [line for line in proc.stderr.splitlines() if "still running stage" in line]
    print(f"\n$ {faults.FAULT_ENV}=stall:environment {' '.join(cmd[2:])} -> exit {proc.returncode}")
    print("\n".join(stuck + [line for line in proc.stderr.splitlines() if "error:" in line]))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    # rank 1 says where it is; rank 0, waiting for it inside the stage, may say so too (its stack
    # then shows the collective it waits in)
    assert any(line.startswith("megatron-dualpipe selftest: rank 1 still running stage 'environment' "
                               f"after {limit:g} s") for line in stuck), proc.stderr[-3000:]
    assert "_stall_if_injected" in proc.stderr  # the stack of the stuck thread
    assert "error: the selftest's processes stopped:" in proc.stderr and "rank 1 exited with code 3" in proc.stderr


_REPORTER = """
import sys, threading, time
from megatron_dualpipe.selftest.watchdog import StageWatchdog
rank, start = int(sys.argv[1]), float(sys.argv[2])
threads = [threading.Thread(target=time.sleep, args=(5,), daemon=True) for _ in range(3)]  # stacks to dump
for thread in threads:
    thread.start()
time.sleep(max(0.0, start - time.time()))
for _ in range(20):
    StageWatchdog(rank, 1.0, 0.1).report("running stage 'x'")
"""


def test_stuck_ranks_reporting_at_once_keep_their_lines_whole():
    """Four ranks dump their stacks into one stderr pipe at the same instant, twenty times each (what
    a stuck job does): every line that comes out is one rank's whole line, marked with the rank, so
    the reader can tell whose thread waits where."""
    ranks = 4
    start = __import__("time").time() + 3.0
    environ = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", _REPORTER, str(rank), str(start)], stderr=write, env=environ)
             for rank in range(ranks)]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    assert [proc.wait(timeout=60) for proc in procs] == [0] * ranks
    line_shape = re.compile(r"(megatron-dualpipe selftest: rank (\d) still running stage 'x' after 1 s .*threads are:"
                            r"|\[rank (\d)\] (main thread 0x[0-9a-f]+|Thread 0x[0-9a-f]+ \(most recent call first\):|Current thread 0x[0-9a-f]+"
                            r" \(most recent call first\):|  File \".*\", line \d+ in \S+))$")
    torn = [line for line in lines if not line_shape.match(line)]
    headers = [line for line in lines if "still running stage" in line]
    print(f"\n{len(lines)} lines from {ranks} ranks, {len(headers)} headers, {len(torn)} torn; e.g.\n" + "\n".join(lines[:6]))
    assert not torn, torn[:5]
    assert sorted(int(line_shape.match(h).group(2)) for h in headers) == sorted(list(range(ranks)) * 20)

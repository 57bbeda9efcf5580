"""The main job (``python -m megatron_dualpipe.apps.main_job``): arguments checked before any process
starts, and a tiny end-to-end run on text through megatron-core's GPTDataset in which DualPipe
and megatron-core's own 1F1B, started from the same weights on the same batches, give the same
losses (training and validation), with its pictures, the measured timeline of one DualPipe
iteration (PNG and Perfetto trace) and the summary written and listed."""
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_dualpipe.apps import main_job as demo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n"


def run_demo(*argv, cwd, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "megatron_dualpipe.apps.main_job", *argv], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


BAD = [
    (["--schedule", "foo"], "invalid choice: 'foo'"),
    (["--nproc", "3"], "set --nproc to 4, or use dualpipev"),
    (["--schedule", "dualpipev", "--num-layers", "6"], "use --num-layers 8"),
    (["--microbatches", "2"], "use --microbatches 4"),
    (["--iters", "0"], "positive integer"),
    (["--hidden-size", "30"], "use --hidden-size 32"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--text", "a.txt", "--data-path", "x"], "not both"),
    (["--data-path", "/no/such/prefix"], "no /no/such/prefix.bin"),
    (["--split", "949,50,1"], "loops forever"),
    (["--split", "1,0,0"], "no validation split"),
]


def _check_refusal(argv, code, stdout, stderr, out):
    lines = stderr.strip().splitlines()
    print(f"\n{' '.join(argv)} -> exit {code}: {lines[-1]}")
    assert code == 2 and "Traceback" not in stderr and "torchrun" not in stdout
    assert [line for line in lines if line.startswith("usage:")] == [lines[-2]]  # one usage line, then the error
    assert lines[-1].startswith("python -m megatron_dualpipe.apps.main_job: error: ")
    assert not out.exists()
    return lines[-1]


def test_bad_arguments_give_one_usage_before_any_process_starts(tmp_path):
    """The command itself, in its own process: exit code 2, one usage line and one error line, no
    traceback, nothing started or written."""
    argv, needle = BAD[1]
    r = run_demo(*argv, "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), cwd=tmp_path,
                 timeout=120)
    assert needle in _check_refusal(argv, r.returncode, r.stdout, r.stderr, tmp_path / "out")


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_each_bad_argument_is_named_with_its_fix(tmp_path, monkeypatch, capsys, argv, needle):
    """Every refusal, in this process (main() as the command calls it): the same checks, without a
    Python start per case."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["python -m megatron_dualpipe.apps.main_job"])
    with pytest.raises(SystemExit) as stop:
        demo.main([*argv, "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert needle in _check_refusal(argv, stop.value.code, captured.out, captured.err, tmp_path / "out")


def test_worker_arguments_round_trip():
    parser = demo.build_parser()
    args = parser.parse_args(["--schedule", "dualpipev", "--iters", "3", "--lr", "0.0007", "--no-compare",
                              "--data-path", "/d/text_document", "--split", "7,2,1", "--nproc", "6"])
    again = parser.parse_args(demo.to_argv(parser, args))
    for dest in demo.LAUNCHER_ONLY[1:]:
        setattr(again, dest, getattr(args, dest))
    assert vars(again) == vars(args)


CORPUS = [
    "Pipeline parallelism splits a model into stages. Micro-batches flow through the stages. " * 3,
    "DualPipe feeds micro-batches from both ends of the pipeline at the same time. " * 3,
    "The weight gradient can wait: zero bubble schedules fill idle time with it. " * 3,
    "Megatron writes tokens to a .bin file and their offsets to a .idx file. " * 3,
    "GPTDataset shuffles documents and cuts samples of sequence length plus one. " * 3,
]


def test_tiny_main_job_dualpipe_equals_1f1b_and_writes_its_pictures(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    for i, doc in enumerate(CORPUS):
        (text / f"{i}.txt").write_text(doc, encoding="utf-8")
    r = run_demo("--nproc", "2", "--num-layers", "2", "--hidden-size", "16", "--seq-length", "16",
                 "--microbatches", "4", "--micro-batch-size", "1", "--iters", "3", "--eval-iters", "1",
                 "--text", str(text), "--vocab-size", "300", "--split", "4,1,0",
                 "--cache-dir", str(tmp_path / "cache"), "--out", "out", cwd=tmp_path)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Warning" not in r.stdout + r.stderr, r.stderr  # the known harmless warnings are silenced
    rows = re.findall(r"^\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \| ", r.stdout, re.M)
    assert [int(i) for i, _, _ in rows] == [1, 2, 3]
    for _, a, b in rows:
        assert abs(float(a) - float(b)) <= 1e-5 * max(1.0, abs(float(b))), (a, b)
    valid = re.search(r"validation lm loss after 3 iterations: dualpipe ([\d.]+), 1f1b ([\d.]+)", r.stdout)
    assert valid and abs(float(valid[1]) - float(valid[2])) <= 1e-5, r.stdout
    assert len(re.findall(r"\[dualpipe\] iteration .* tokens per second: +\d+ ", r.stdout)) == 3
    assert "through megatron-core's GPTDataset" in r.stdout

    out = tmp_path / "out"
    listed = r.stdout.split("files written:")[1]
    for name in ("loss.png", "timeline.png", "trace.json", "dualpipe_pp2_m4.png", "summary.md"):
        path = out / name
        assert path.stat().st_size > 0 and os.path.join("out", name) in listed, name
    for name in ("loss.png", "timeline.png", "dualpipe_pp2_m4.png"):
        assert (out / name).read_bytes()[:8] == PNG
    trace = json.loads((out / "trace.json").read_text(encoding="utf-8"))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["name"] != "wait"]
    assert {e["tid"] for e in slices} == {0, 1} and len(slices) >= 2 * 4  # measured: both ranks, every F
    assert "measured" in r.stdout and "simulated" in r.stdout
    summary = (out / "summary.md").read_text(encoding="utf-8")
    assert "![loss](loss.png)" in summary and "![timeline](timeline.png)" in summary and "| dualpipe |" in summary and "| 1f1b |" in summary
    assert "data" in listed and "text_document.bin" in listed  # built on this first run, and listed
    # DualPipe and 1F1B simulated side by side at the same scale, makespans printed and in the summary,
    # equal to an independent simulation of both; and why the wall times above do not show them.
    from megatron_dualpipe.apps.report import simulated_pair

    _, makespans = simulated_pair("dualpipe", 2, 4)
    (_, t_dual), (_, t_one) = makespans
    assert f"dualpipe makespan {t_dual:g}, 1f1b {t_one:g}" in r.stdout
    assert (out / "dualpipe_vs_1f1b_pp2_m4.png").read_bytes()[:8] == PNG and "dualpipe_vs_1f1b_pp2_m4.png" in listed
    assert f"dualpipe makespan {t_dual:g}, 1f1b {t_one:g}" in summary and "![dualpipe_vs_1f1b_pp2_m4]" in summary
    assert "CPU wall time does not show bubbles" in r.stdout and "CPU wall time does not show bubbles" in summary

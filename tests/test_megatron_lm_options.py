"""Megatron-LM options under ``--pipeline-schedule dualpipe``, each against Megatron's own ``1f1b``
through ``pretrain_gpt.py`` (CPU, 4 gloo ranks, pp=4, tiny GPT, dropout off, same seed, 3
iterations): every metric ``training_log`` prints (lm loss, grad norm, params norm, zeros, MoE aux
losses) must agree to what its print resolves; the largest difference per metric is printed
(``pytest -s``). docs/megatron-options.md lists every option with its status and test.

Options that do not change the mathematics are grouped into one run each, to keep the number of
``torchrun`` launches (~20 s each on 2 cores) small.
"""
import os
import re
import signal
import subprocess
import time

import pytest

from megatron_lm_runs import (HAVE_MEGATRON_LM, LOSS_RE, MOE, SKIP_MESSAGE, assert_metrics_close, command, launch,
                              metrics, run_pretrain)

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)

ITERS = ("--train-iters", "3")

DUALPIPE = (("dualpipe", ()),)

# name -> (arguments of every run, [(schedule, extra arguments)] compared with 1f1b on the same arguments)
CASES = {
    # The bd sums start per chunk as soon as its last W is done; with --overlap-grad-reduce the
    # data-parallel reduction of each chunk (Megatron's grad_sync_func) follows its bd sum.
    "untied, full recompute, per-token loss, decoupled lr, overlap-grad-reduce": ((
        "--untie-embeddings-and-output-weights", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--calculate-per-token-loss", "--decoupled-lr", "3e-3",
        "--log-params-norm", "--log-num-zeros-in-grad", "--overlap-grad-reduce"), DUALPIPE),
    "MoE aux-loss-free (expert bias), selective recompute": ((
        *MOE, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05", "--moe-router-load-balancing-type", "none",
        "--recompute-granularity", "selective", "--log-params-norm"), DUALPIPE),
    "overlap-grad-reduce, pp=2 x dp=2, no zero bubble": (
        ("--overlap-grad-reduce", "--pipeline-model-parallel-size", "2"),
        (("dualpipe", ("--no-dualpipe-zero-bubble",)),)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_option_dualpipe_equals_1f1b(name):
    args, variants = CASES[name]
    ref = run_pretrain("1f1b", *args, *ITERS, with_metrics=True)
    for schedule, extra in variants:
        got = run_pretrain(schedule, *args, *extra, *ITERS, with_metrics=True)
        worst = assert_metrics_close(got, ref, f"{name}: {schedule} {' '.join(extra)} vs 1f1b".replace("  ", " "))
        assert "lm loss" in worst


def test_distributed_optimizer(tmp_path):
    """The distributed optimizer: trained with --overlap-grad-reduce --overlap-param-gather (and an
    empty --load directory) against 1f1b without them; --load used to fail on every DualPipe load
    (the mirror sync did not know the distributed optimizer): a checkpoint resumed with
    --no-load-optim, against 1f1b doing the same."""
    dist_opt = ("--use-distributed-optimizer", "--ckpt-format", "torch")
    rc, out = launch("1f1b", *dist_opt, *ITERS, "--save", str(tmp_path / "ck"), "--save-interval", "2")
    if rc != 0 and "Wrapped parameters must be one of torch.cuda" in out:
        pytest.skip("Megatron's distributed optimizer does not run on CPU without the CPU mode's support for it")
    assert rc == 0, out[-6000:]
    (tmp_path / "empty").mkdir()
    overlapped = run_pretrain("dualpipe", *dist_opt, *ITERS, "--overlap-grad-reduce", "--overlap-param-gather",
                              "--load", str(tmp_path / "empty"), with_metrics=True)
    assert_metrics_close(overlapped, metrics(out), "distributed optimizer, --overlap-grad-reduce "
                                                   "--overlap-param-gather, empty --load: dualpipe vs 1f1b")
    resume = (*dist_opt, "--load", str(tmp_path / "ck"), "--no-load-optim", "--ckpt-step", "2", "--train-iters", "4")
    assert_metrics_close(run_pretrain("dualpipe", *resume, with_metrics=True),
                         run_pretrain("1f1b", *resume, with_metrics=True),
                         "distributed optimizer, --load --no-load-optim: dualpipe vs 1f1b")


FAULT_HOOKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_hooks")
UNEXPECTED_RE = re.compile(r"Unexpected result nan on rank (\d+) at iteration #(\d+) invocation #\d+ \(message='([^']+)'\)")


def test_nan_in_one_microbatch_is_caught_as_under_1f1b(tmp_path):
    """--check-for-nan-in-loss-and-grad (on by default, with Megatron's rerun state machine): a NaN
    in the loss of the last micro-batch of iteration 3 (direction 1 under DualPipe, so its loss is
    computed on pipeline rank 0, not pp-1) is caught in iteration 3 with the same messages as under
    1f1b: the rank computing that loss finds the NaN loss, every other rank the NaN gradients; the
    step is rerun (the data iterator rewound and replayed through the executor), and the job saves
    a checkpoint and stops."""
    found = {}
    for schedule, loss_rank in (("1f1b", 3), ("dualpipe", 0)):
        rc, out = launch(schedule, "--train-iters", "4", "--ckpt-format", "torch", "--save", str(tmp_path / schedule), "--save-interval", "100",
                         env_extra={"MEGATRON_DUALPIPE_TEST_NAN": "3,7"}, pythonpath=(FAULT_HOOKS,))
        reports = {(int(r), int(it), msg) for r, it, msg in UNEXPECTED_RE.findall(out)}
        print(f"\n{schedule}: exit code {rc}; " + "; ".join(f"rank {r} iteration {it}: {m}" for r, it, m in sorted(reports)))
        assert rc != 0 and "Saving a checkpoint and exiting now" in out, out[-4000:]
        by_rank = {r: (it, m) for r, it, m in reports}
        assert sorted(by_rank) == [0, 1, 2, 3], reports
        assert by_rank[loss_rank] == (3, "found NaN in local forward loss calculation"), reports
        assert all(it == 3 and "found NaN in local grad norm" in m for r, (it, m) in by_rank.items() if r != loss_rank)
        found[schedule] = {m for _, m in by_rank.values()}
    assert found["dualpipe"] == found["1f1b"]


def _worker_pid(parent: int, local_rank: int):
    """The pid of torchrun's worker process with LOCAL_RANK=local_rank (a child of ``parent``)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env:
            return int(entry)
    return None


def test_rank_killed_mid_iteration_restarts_and_continues_the_curve(tmp_path):
    """A rank SIGKILLed during iteration 4 of a dualpipe run under ``torchrun --max-restarts 1``
    with a checkpoint every 2 iterations: the job does not hang, torchrun restarts it, it resumes
    from the last checkpoint and its losses continue the uninterrupted run's curve."""
    if not os.path.isdir("/proc"):
        pytest.skip("finds the worker to kill through /proc")
    ckpt = ("--ckpt-format", "torch", "--save-interval", "2", "--train-iters", "5")
    full = run_pretrain("dualpipe", "--ckpt-format", "torch", "--train-iters", "5")
    cmd, env = command("dualpipe", *ckpt, "--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"),
                       torchrun_args=("--max-restarts", "1", "--monitor-interval", "0.5"))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, killed = [], None
    deadline = time.monotonic() + 900
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed is None and re.search(r"iteration\s+3/\s*5 \|", line):
                killed = _worker_pid(proc.pid, 2)
                assert killed is not None, "no worker with LOCAL_RANK=2"
                os.kill(killed, signal.SIGKILL)
            assert time.monotonic() < deadline, "the job did not finish in time"
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert killed is not None, out[-4000:]
    assert rc == 0, out[-6000:]
    # Losses logged after the restart: the iterations after the last checkpoint. Megatron logs the
    # second iteration of a run as the mean of the first two (see test_megatron_lm_dualpipe.py).
    runs = out.split("successfully saved checkpoint")
    logged = [(int(i), float(v)) for i, v in LOSS_RE.findall(out)]
    restart = max(k for k in range(1, len(logged)) if logged[k][0] <= logged[k - 1][0])
    after = dict(logged[restart:])
    first = min(after)
    true = {i: (2 * v - after[i - 1] if i == first + 1 else v) for i, v in after.items()}
    print(f"\nkilled local rank 2 (pid {killed}) after iteration 3; resumed at iteration {first}: "
          + ", ".join(f"{i}: {v:.6f} (uninterrupted {full[i]:.6f})" for i, v in sorted(true.items())))
    assert len(runs) >= 2 and first <= 5
    for i, v in true.items():
        assert abs(v - full[i]) <= 1e-5 * abs(full[i]), (i, v, full[i])

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

import pytest

from megatron_lm_runs import HAVE_MEGATRON_LM, MOE, SKIP_MESSAGE, assert_metrics_close, launch, metrics, run_pretrain

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

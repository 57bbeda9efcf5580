"""Megatron-LM options under ``--pipeline-schedule dualpipe``, each against Megatron's own ``1f1b``
through ``pretrain_gpt.py`` (CPU, 4 gloo ranks, pp=4, tiny GPT, dropout off, same seed, 3
iterations): every metric ``training_log`` prints (lm loss, grad norm, params norm, zeros, MoE aux
losses) must agree to what its print resolves; the largest difference per metric is printed
(``pytest -s``). docs/megatron-options.md lists every option with its status and test.

Options that do not change the mathematics are grouped into one run each, to keep the number of
``torchrun`` launches (~20 s each on 2 cores) small.
"""
import pytest

from megatron_lm_runs import HAVE_MEGATRON_LM, MOE, SKIP_MESSAGE, assert_metrics_close, launch, run_pretrain

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)

ITERS = ("--train-iters", "3")

CASES = {
    "untied, full recompute, per-token loss, decoupled lr": (
        "--untie-embeddings-and-output-weights", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--calculate-per-token-loss", "--decoupled-lr", "3e-3",
        "--log-params-norm", "--log-num-zeros-in-grad"),
    "MoE aux-loss-free (expert bias), selective recompute": (
        *MOE, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "0.05", "--moe-router-load-balancing-type", "none",
        "--recompute-granularity", "selective", "--log-params-norm"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_option_dualpipe_equals_1f1b(name):
    args = (*CASES[name], *ITERS)
    ref = run_pretrain("1f1b", *args, with_metrics=True)
    got = run_pretrain("dualpipe", *args, with_metrics=True)
    worst = assert_metrics_close(got, ref, f"{name}: dualpipe vs 1f1b")
    assert "lm loss" in worst


def test_distributed_optimizer_load_without_optimizer_state(tmp_path):
    """--use-distributed-optimizer + --load used to fail on every DualPipe load (the mirror sync
    did not know the distributed optimizer): an empty load directory, and a checkpoint resumed
    with --no-load-optim, against 1f1b doing the same."""
    dist_opt = ("--use-distributed-optimizer", "--ckpt-format", "torch")
    rc, out = launch("1f1b", *dist_opt, *ITERS, "--save", str(tmp_path / "ck"), "--save-interval", "2")
    if rc != 0 and "Wrapped parameters must be one of torch.cuda" in out:
        pytest.skip("Megatron's distributed optimizer does not run on CPU without the CPU mode's support for it")
    assert rc == 0, out[-6000:]
    (tmp_path / "empty").mkdir()
    run_pretrain("dualpipe", *dist_opt, *ITERS, "--load", str(tmp_path / "empty"))
    resume = (*dist_opt, "--load", str(tmp_path / "ck"), "--no-load-optim", "--ckpt-step", "2", "--train-iters", "4")
    assert_metrics_close(run_pretrain("dualpipe", *resume, with_metrics=True),
                         run_pretrain("1f1b", *resume, with_metrics=True),
                         "distributed optimizer, --load --no-load-optim: dualpipe vs 1f1b")

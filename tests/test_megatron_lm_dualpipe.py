"""Megatron-LM's own ``pretrain_gpt.py`` trained with ``--pipeline-schedule dualpipe`` on CPU.

Needs a Megatron-LM checkout at tag ``core_v0.16.1`` in ``MEGATRON_LM_PATH`` (skipped otherwise;
CI has none). Every case is a ``torchrun`` of 4 gloo processes (pp=4, the tiny GPT of
docs/megatron-lm-cpu.md, mock data, dropout off so that the micro-batch order cannot change the
dropout masks), ~15-25 s each.

What is shown (losses are printed; run with ``-s`` to see them):

* per-iteration ``lm loss`` of ``dualpipe`` (zero bubble on), ``executor-1f1b`` (our executor,
  1F1B order) and Megatron's own ``1f1b`` agree to 1e-5 relative; the same for a tiny MoE
  (4 experts, top-2, alltoall dispatcher);
* a ``--ckpt-format torch`` checkpoint written at iteration 3 by ``dualpipe`` resumes under
  ``1f1b`` and one written by ``1f1b`` resumes under ``dualpipe``; iterations 4-5 after resume
  equal the uninterrupted run's.

Megatron's logging quirk: ``training_log`` does not reset its loss accumulator after the first
iteration a run executes (``should_reset = not is_first_iteration``), so the line logged for the
*second* iteration of a run is the mean of the first two. In the uninterrupted run that is
iteration 2; in a resumed run it is iteration 5, logged as (L4 + L5) / 2. The comparison
therefore recovers L5 = 2 * logged5 - logged4 for resumed runs (and compares the resumed
runs with each other as logged).
"""

import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")
SKIP_MESSAGE = "set MEGATRON_LM_PATH to a Megatron-LM checkout at tag core_v0.16.1 (pretrain_gpt.py runs)"

pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_PATH or not os.path.isfile(os.path.join(MEGATRON_LM_PATH or "", "pretrain_gpt.py")),
    reason=SKIP_MESSAGE,
)

TINY = [
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--distributed-backend", "gloo", "--use-cpu-initialization", "--pipeline-model-parallel-size", "4",
    "--train-iters", "5", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant", "--seed", "1234",
    "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--disable-bias-linear"]
RTOL = 1e-5
LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


def _require_deps():
    import importlib.util

    missing = [p for m, p in (("six", "six"), ("regex", "regex"), ("yaml", "pyyaml"), ("pydantic", "pydantic"),
                              ("pybind11", "pybind11")) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM's training code needs: pip install {' '.join(missing)}")


LAST_OUTPUT = [""]  # the most recent run's output, for checks beyond the losses
VAL_RE = re.compile(r"validation loss at iteration (\d+)( on \w+ set)? \| lm loss value: ([0-9.E+-]+)")


def run_pretrain(schedule, *extra, timeout=600, evaluation=False):
    """torchrun pretrain_gpt.py (4 ranks) through the launcher; returns {iteration: lm loss}
    (with ``evaluation``, {"iteration (set)": validation lm loss} as well)."""
    _require_deps()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun if os.path.exists(torchrun) else "torchrun", "--standalone", "--nproc-per-node", "4",
           "-m", "megatron_dualpipe.launch", os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py"),
           *TINY, "--pipeline-schedule", schedule, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    LAST_OUTPUT[0] = out
    assert proc.returncode == 0, f"{schedule} {' '.join(extra)} failed:\n{out[-6000:]}"
    losses = {int(i): float(v) for i, v in LOSS_RE.findall(out)}
    assert losses, f"no 'lm loss' lines in the output:\n{out[-3000:]}"
    print(f"\n{schedule:14s} {' '.join(extra)[:80]}: " + ", ".join(f"{i}: {v:.6f}" for i, v in sorted(losses.items())))
    if evaluation:
        val = {f"{i}{where}": float(v) for i, where, v in VAL_RE.findall(out)}
        assert val, f"no validation loss lines in the output:\n{out[-3000:]}"
        print(f"{schedule:14s} evaluation: " + ", ".join(f"{k}: {v:.6f}" for k, v in val.items()))
        return losses, val
    return losses


def assert_close(a, b, what):
    assert sorted(a) == sorted(b), (what, a, b)
    for i in a:
        assert abs(a[i] - b[i]) <= RTOL * abs(b[i]), f"{what}: iteration {i}: {a[i]} vs {b[i]}"


CHUNKS_RE = re.compile(r"\[megatron-dualpipe\] (\w+) pipeline rank (\d+): (.*)")


def test_dualpipe_zb_h1_executor_1f1b_and_megatron_1f1b_losses_equal():
    ref = run_pretrain("1f1b")
    assert_close(run_pretrain("executor-1f1b"), ref, "executor-1f1b vs 1f1b")
    assert_close(run_pretrain("zb-h1"), ref, "zb-h1 (executor, zero bubble) vs 1f1b")
    assert_close(run_pretrain("dualpipe"), ref, "dualpipe (zero bubble) vs 1f1b")
    # The hooked get_model built stage i and stage pp-1-i on every rank (8 layers, pp=4).
    chunks = {int(r): text for s, r, text in CHUNKS_RE.findall(LAST_OUTPUT[0]) if s == "dualpipe"}
    print("\n" + "\n".join(f"rank {r}: {t}" for r, t in sorted(chunks.items())))
    assert chunks == {
        0: "model[0] stage 0/4 layers 1-2 +embedding; model[1] stage 3/4 layers 7-8 +output",
        1: "model[0] stage 1/4 layers 3-4; model[1] stage 2/4 layers 5-6",
        2: "model[0] stage 2/4 layers 5-6; model[1] stage 1/4 layers 3-4",
        3: "model[0] stage 3/4 layers 7-8 +output; model[1] stage 0/4 layers 1-2 +embedding",
    }


def test_evaluation_losses_equal():
    """Evaluation runs the schedule forward-only (8 micro-batches, both directions)."""
    args = ("--train-iters", "4", "--eval-iters", "2", "--eval-interval", "2")
    ref_train, ref_val = run_pretrain("1f1b", *args, evaluation=True)
    train, val = run_pretrain("dualpipe", *args, evaluation=True)
    assert_close(train, ref_train, "dualpipe vs 1f1b training")
    assert_close(val, ref_val, "dualpipe vs 1f1b validation/test")


def test_moe_dualpipe_equals_1f1b():
    ref = run_pretrain("1f1b", *MOE, "--train-iters", "3")
    assert_close(run_pretrain("dualpipe", *MOE, "--train-iters", "3"), ref, "MoE dualpipe vs 1f1b")


def _resumed_true_losses(logged):
    """{4: L4, 5: L5} from a resumed run's log (see the module docstring)."""
    return {4: logged[4], 5: 2 * logged[5] - logged[4]}


def test_torch_checkpoint_switches_schedules(tmp_path):
    ckpt = ["--ckpt-format", "torch", "--save-interval", "3", "--exit-interval", "3"]
    full = run_pretrain("1f1b")
    dp_ckpt, f1_ckpt = str(tmp_path / "dualpipe"), str(tmp_path / "1f1b")
    saved_dp = run_pretrain("dualpipe", *ckpt, "--save", dp_ckpt)
    saved_f1 = run_pretrain("1f1b", *ckpt, "--save", f1_ckpt)
    assert sorted(saved_dp) == sorted(saved_f1) == [1, 2, 3]
    assert_close(saved_dp, {i: full[i] for i in (1, 2, 3)}, "dualpipe before save")

    resumed = {
        "dualpipe -> 1f1b": run_pretrain("1f1b", "--ckpt-format", "torch", "--load", dp_ckpt),
        "1f1b -> dualpipe": run_pretrain("dualpipe", "--ckpt-format", "torch", "--load", f1_ckpt),
        "1f1b -> 1f1b": run_pretrain("1f1b", "--ckpt-format", "torch", "--load", f1_ckpt),
    }
    for what, logged in resumed.items():
        assert sorted(logged) == [4, 5], (what, logged)
        assert_close(logged, resumed["1f1b -> 1f1b"], f"{what} vs 1f1b -> 1f1b (as logged)")
        assert_close(_resumed_true_losses(logged), {4: full[4], 5: full[5]}, f"{what} vs uninterrupted")


def test_dualpipe_resume_without_optimizer_state(tmp_path):
    """--no-load-optim: fresh Adam state on both copies; must match 1f1b doing the same."""
    ckpt = str(tmp_path / "ck")
    run_pretrain("dualpipe", "--ckpt-format", "torch", "--save-interval", "3", "--exit-interval", "3",
                 "--save", ckpt)
    a = run_pretrain("dualpipe", "--ckpt-format", "torch", "--load", ckpt, "--no-load-optim")
    b = run_pretrain("1f1b", "--ckpt-format", "torch", "--load", ckpt, "--no-load-optim")
    assert_close(a, b, "dualpipe vs 1f1b after --no-load-optim resume")

"""Megatron's *own* 1F1B (``--pipeline-schedule 1f1b``) through ``pretrain_gpt.py`` on CPU, with the
configurations CPU mode covers (``megatron_dualpipe.cpu``): the distributed optimizer, bf16, tensor
parallel 2 with sequence parallelism, and ``torch_dist`` checkpoints (save and resume).

Every run is the tiny GPT of ``megatron_lm_runs.TINY`` cut to 4 layers over pp = 2 (global batch
8 = 4 micro-batches of 2), fp32 unless said otherwise. The reference is one plain run (pp = 2,
dp = tp = 1), which also writes the ``torch_dist`` checkpoint at iteration 2 that the resume
test loads. Splitting the same data over dp = 2 (with the distributed optimizer) or over tp = 2
(sequence parallel) does not change the arithmetic of the model, so those runs must print the
reference's losses and gradient norms; bf16 must stay within bf16 rounding of it.

Megatron's logging quirk (see tests/test_megatron_lm_dualpipe.py): the second iteration a run
executes is logged as the mean of its first two, so a run resumed at iteration 2 logs
iteration 4 as (L3 + L4) / 2.
"""

import math
import os

import pytest
import torch

from megatron_lm_runs import HAVE_MEGATRON_LM, RTOL, SKIP_MESSAGE, assert_metrics_close, run_pretrain

pytestmark = [
    pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests; CPU mode is never active next to a GPU"),
]

PP2 = ["--num-layers", "4", "--global-batch-size", "8", "--pipeline-model-parallel-size", "2"]
TORCH_DIST = ["--ckpt-format", "torch_dist", "--save-interval", "2"]


def _run(nproc, *extra, iters):
    """Megatron's 1f1b on the pp = 2 model: {iteration: {metric: printed value}}."""
    return run_pretrain("1f1b", *PP2, "--train-iters", str(iters), *extra, nproc=nproc, with_metrics=True)


def _losses(run):
    return {i: float(m["lm loss"]) for i, m in run.items()}


def _assert_trains(run, what):
    losses = [v for _, v in sorted(_losses(run).items())]
    assert all(math.isfinite(v) for v in losses), (what, losses)
    assert losses[-1] < losses[0], f"{what}: the loss does not decrease: {losses}"


def _assert_resumed_continues(resumed, ref, what):
    """A run resumed at iteration 2 continues the uninterrupted curve (L3, L4 from its log)."""
    logged = _losses(resumed)
    assert sorted(logged) == [3, 4], logged
    true = {3: logged[3], 4: 2 * logged[4] - logged[3]}
    want = _losses(ref)
    diff = max(abs(true[i] - want[i]) / want[i] for i in (3, 4))
    print(f"{what}: resumed L3, L4 = {true[3]:.6f}, {true[4]:.6f}; uninterrupted {want[3]:.6f}, "
          f"{want[4]:.6f}; max relative difference {diff:.2e}")
    assert diff <= RTOL, what


def _resume_from_iteration_2(ckpt, nproc, *extra):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    return _run(nproc, *extra, "--ckpt-format", "torch_dist", "--load", ckpt, iters=4)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain 1f1b, 4 iterations, a torch_dist checkpoint at iterations 2 and 4."""
    ckpt = str(tmp_path_factory.mktemp("torch_dist") / "ckpt")
    run = _run(2, *TORCH_DIST, "--save", ckpt, iters=4)
    _assert_trains(run, "reference")
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    return run, ckpt


def test_torch_dist_save_and_resume(reference):
    """The torch_dist writer used to hang on CPU (megatron_dualpipe/cpu/mcore.py: psutil)."""
    ref, ckpt = reference
    _assert_resumed_continues(_resume_from_iteration_2(ckpt, 2), ref, "torch_dist resume")


def test_distributed_optimizer_trains_and_resumes(reference, tmp_path):
    """dp = 2 (4 processes), the optimizer state sharded over dp; torch_dist save and resume."""
    ref, _ = reference
    ckpt = str(tmp_path / "ckpt")
    run = _run(4, "--use-distributed-optimizer", *TORCH_DIST, "--save", ckpt, iters=4)
    _assert_trains(run, "distributed optimizer")
    assert_metrics_close(run, ref, "distributed optimizer dp=2 vs reference")
    resumed = _resume_from_iteration_2(ckpt, 4, "--use-distributed-optimizer")
    _assert_resumed_continues(resumed, ref, "distributed optimizer torch_dist resume")


def test_bf16(reference):
    ref, _ = reference
    run = _run(2, "--bf16", iters=3)
    _assert_trains(run, "bf16")
    got, want = _losses(run), _losses(ref)
    diff = max(abs(got[i] - want[i]) / want[i] for i in got)
    print(f"bf16 vs fp32 reference: max relative difference of lm loss {diff:.2e}")
    assert diff <= 5e-3  # bf16 keeps 8 bits of mantissa; fp32 main weights and gradients


def test_tensor_parallel_2_with_sequence_parallel(reference):
    ref, _ = reference
    run = _run(4, "--tensor-model-parallel-size", "2", "--sequence-parallel", iters=3)
    _assert_trains(run, "tp=2 sequence parallel")
    assert_metrics_close(run, {i: ref[i] for i in run}, "tp=2 sequence parallel vs reference")

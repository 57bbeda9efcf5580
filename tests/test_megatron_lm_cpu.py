"""Megatron's *own* 1F1B (``--pipeline-schedule 1f1b``) through ``pretrain_gpt.py`` on CPU, with the
configurations CPU mode covers (``megatron_dualpipe.cpu``): the distributed optimizer, bf16, tensor
parallel 2 with sequence parallelism, and ``torch_dist`` checkpoints (save and resume).

Every run is the tiny GPT of ``harness.pretrain_gpt.TINY_GPT`` with pp = 2 (global batch 8 =
4 micro-batches of 2), fp32 unless said otherwise. The reference is one plain run (pp = 2,
dp = tp = 1), which also writes the ``torch_dist`` checkpoint at iteration 2 that the resume
test loads. Splitting the same data over dp = 2 (with the distributed optimizer) or over tp = 2
(sequence parallel) does not change the arithmetic of the model, so those runs must log the
reference's losses and gradient norms to 1e-5; bf16 must stay within bf16 rounding of it.

Megatron's logging quirk (see tests/test_megatron_lm_dualpipe.py): the second iteration a run
executes is logged as the mean of its first two, so a run resumed at iteration 2 logs
iteration 4 as (L3 + L4) / 2.
"""

import math
import os

import pytest
import torch

from harness.pretrain_gpt import MEGATRON_LM_PATH, SKIP_MESSAGE, TINY_GPT, max_relative_difference, run_pretrain_gpt

pytestmark = [
    pytest.mark.skipif(
        not MEGATRON_LM_PATH or not os.path.isfile(os.path.join(MEGATRON_LM_PATH or "", "pretrain_gpt.py")),
        reason=SKIP_MESSAGE,
    ),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests; CPU mode is never active next to a GPU"),
]

RTOL = 1e-5
PP2 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]
TORCH_DIST = ["--ckpt-format", "torch_dist", "--save-interval", "2"]


def _iters(n):
    return ["--train-iters", str(n)]


def _assert_trains(run, what):
    losses = [run.losses[i] for i in sorted(run.losses)]
    assert all(math.isfinite(v) for v in losses), (what, losses)
    assert losses[-1] < losses[0], f"{what}: the loss does not decrease: {losses}"


def _assert_same_as(run, ref, iterations, what, rtol=RTOL):
    loss_diff = max_relative_difference(run.losses, ref.losses, iterations)
    norm_diff = max_relative_difference(run.grad_norms, ref.grad_norms, iterations)
    print(f"{what} vs reference, iterations {iterations}: max relative difference lm loss "
          f"{loss_diff:.2e}, grad norm {norm_diff:.2e}")
    assert loss_diff <= rtol and norm_diff <= max(rtol, 1e-3), what  # grad norm is logged to 3 decimals


def _resumed_true_losses(logged, first):
    """{first: L, first+1: L} from a resumed run's log (the second line is a two-iteration mean)."""
    return {first: logged[first], first + 1: 2 * logged[first + 1] - logged[first]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain 1f1b, 4 iterations, a torch_dist checkpoint at iteration 2 (and 4)."""
    ckpt = str(tmp_path_factory.mktemp("torch_dist") / "ckpt")
    run = run_pretrain_gpt(2, TINY_GPT + PP2 + _iters(4) + TORCH_DIST + ["--save", ckpt],
                           label="1f1b pp=2 (reference, torch_dist save)")
    _assert_trains(run, "reference")
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    return run, ckpt


def _resume_from_iteration_2(ckpt, nproc, extra, label):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    return run_pretrain_gpt(nproc, TINY_GPT + PP2 + _iters(4) + extra + ["--ckpt-format", "torch_dist", "--load", ckpt],
                            label=label)


def test_torch_dist_save_and_resume(reference):
    """The torch_dist writer used to hang on CPU (see megatron_dualpipe/cpu/mcore.py: psutil)."""
    ref, ckpt = reference
    resumed = _resume_from_iteration_2(ckpt, 2, [], "1f1b pp=2 resumed from the torch_dist checkpoint")
    assert sorted(resumed.losses) == [3, 4]
    true = _resumed_true_losses(resumed.losses, 3)
    diff = max_relative_difference(true, ref.losses, [3, 4])
    print(f"resumed L3, L4 = {true[3]:.6f}, {true[4]:.6f}; uninterrupted {ref.losses[3]:.6f}, "
          f"{ref.losses[4]:.6f}; max relative difference {diff:.2e}")
    assert diff <= RTOL


def test_distributed_optimizer_trains_and_resumes(reference, tmp_path):
    """dp = 2 (4 processes), the optimizer state sharded over dp; torch_dist save and resume."""
    ref, _ = reference
    ckpt = str(tmp_path / "ckpt")
    distopt = ["--use-distributed-optimizer"]
    run = run_pretrain_gpt(4, TINY_GPT + PP2 + _iters(4) + distopt + TORCH_DIST + ["--save", ckpt],
                           label="1f1b pp=2 dp=2 --use-distributed-optimizer")
    _assert_trains(run, "distributed optimizer")
    _assert_same_as(run, ref, [1, 2, 3, 4], "distributed optimizer")
    resumed = _resume_from_iteration_2(ckpt, 4, distopt, "... resumed from its torch_dist checkpoint")
    true = _resumed_true_losses(resumed.losses, 3)
    diff = max_relative_difference(true, ref.losses, [3, 4])
    print(f"distributed optimizer resumed L3, L4 = {true[3]:.6f}, {true[4]:.6f}; max relative "
          f"difference from the uninterrupted run {diff:.2e}")
    assert diff <= RTOL


def test_bf16(reference):
    ref, _ = reference
    run = run_pretrain_gpt(2, TINY_GPT + PP2 + _iters(3) + ["--bf16"], label="1f1b pp=2 --bf16")
    _assert_trains(run, "bf16")
    diff = max_relative_difference(run.losses, ref.losses, [1, 2, 3])
    print(f"bf16 vs fp32 reference: max relative difference of lm loss {diff:.2e}")
    assert diff <= 5e-3  # bf16 keeps 8 bits of mantissa; fp32 main weights and gradients


def test_tensor_parallel_2_with_sequence_parallel(reference):
    ref, _ = reference
    run = run_pretrain_gpt(4, TINY_GPT + PP2 + _iters(3) + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                           label="1f1b tp=2 pp=2 --sequence-parallel")
    _assert_trains(run, "tp=2 sequence parallel")
    _assert_same_as(run, ref, [1, 2, 3], "tp=2 sequence parallel")

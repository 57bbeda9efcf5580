"""The grouped_gemm stand-in (``megatron_dualpipe.cpu.stand_ins.grouped_gemm``) keeps the library's contract.

Contract: ``ops.gmm`` forward and backward equal a float64 loop of per-group matmuls (with and
without ``trans_b``, an empty group among them) up to the one bfloat16 rounding the library makes;
the calls the library refuses are refused. megatron-core 0.16.1: ``grouped_gemm_util`` accepts the
stand-in, and a tiny bfloat16 MoE GPT with the legacy GroupedMLP (``moe_grouped_gemm=True``, local
spec) equals the same model with SequentialMLP on the same weights: the loss and every gradient.
"""
from __future__ import annotations

import pytest
import torch

from harness import megatron_env as me
from megatron_dualpipe.cpu.stand_ins.grouped_gemm import backend, ops

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-mode stand-in; on a GPU machine the real grouped_gemm runs"
)

#: One bfloat16 rounding of each result (2^-8 relative) against float64, over the largest value.
RTOL_BF16 = 8e-3
SIZES = [3, 0, 5, 2]  # rows per group; the second group is empty
K, N = 8, 6


def _operands(trans_b: bool):
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(sum(SIZES), K, generator=gen).to(torch.bfloat16)
    b = torch.randn(len(SIZES), *((N, K) if trans_b else (K, N)), generator=gen).to(torch.bfloat16)
    grad = torch.randn(sum(SIZES), N, generator=gen).to(torch.bfloat16)
    return a, b, grad


def _loop_reference(a, b, grad, trans_b):
    """Per group in float64: output rows and, by autograd, the gradients of ``sum(out * grad)``."""
    a64 = a.double().requires_grad_()
    b64 = b.double().requires_grad_()
    outs, start = [], 0
    for i, rows in enumerate(SIZES):
        weight = b64[i].t() if trans_b else b64[i]
        outs.append(a64[start:start + rows] @ weight)
        start += rows
    out = torch.cat(outs)
    (out * grad.double()).sum().backward()
    return out.detach(), a64.grad, b64.grad


def _gap(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "b_transposed"])
def test_gmm_forward_and_backward_equal_a_loop_of_matmuls(trans_b):
    a, b, grad = _operands(trans_b)
    want_out, want_da, want_db = _loop_reference(a, b, grad, trans_b)
    a_in, b_in = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = ops.gmm(a_in, b_in, torch.tensor(SIZES), trans_b=trans_b)
    (out.float() * grad.float()).sum().backward()
    gaps = {"out": _gap(out, want_out), "grad a": _gap(a_in.grad, want_da), "grad b": _gap(b_in.grad, want_db)}
    print(f"\ngmm groups {SIZES}, trans_b={trans_b}: " + ", ".join(f"{k} rel {v:.2e}" for k, v in gaps.items()))
    assert out.dtype == a_in.grad.dtype == b_in.grad.dtype == torch.bfloat16
    assert all(v <= RTOL_BF16 for v in gaps.values()), gaps
    assert torch.count_nonzero(b_in.grad[1]) == 0  # the empty group's weight gets a zero gradient


def test_gmm_refuses_what_grouped_gemm_refuses():
    a, b, _ = _operands(False)
    sizes = torch.tensor(SIZES)
    cases = {
        "float32 operands": lambda: ops.gmm(a.float(), b.float(), sizes),
        "int32 batch sizes": lambda: ops.gmm(a, b, sizes.int()),
        "a size per group missing": lambda: ops.gmm(a, b, sizes[:-1]),
        "sizes not adding up to the rows": lambda: ops.gmm(a, b, sizes + 1),
        "a non-contiguous a": lambda: ops.gmm(a.t().contiguous().t(), b, sizes),
        "trans_a with trans_b": lambda: backend.gmm(a, a, sizes, trans_a=True, trans_b=True),
        "every group empty": lambda: ops.gmm(a[:0], b, torch.zeros(4, dtype=torch.int64)),
    }
    print()
    for name, call in cases.items():
        with pytest.raises((RuntimeError, AssertionError)) as error:
            call()
        print(f"  refused {name}: {error.value}")


# ----------------------------------------------------------------------------------------------
# megatron-core 0.16.1's legacy GroupedMLP on the stand-in


def _grouped_mlp_worker(rank, world, port):
    """The same tiny MoE GPT (ep=world, alltoall) with SequentialMLP and with GroupedMLP."""
    from harness import stand_in_moe as moe

    moe.start(rank, world, port, ["grouped_gemm"], ep=world)
    try:
        from megatron.core.transformer.moe import grouped_gemm_util as gg

        gg.assert_grouped_gemm_is_available()
        used = gg.ops.__name__
        batch = moe.DATA.batches(world, seed=11)[rank]
        reference = moe.build(moe.moe_config("alltoall"))
        grouped = moe.build(moe.moe_config("alltoall", grouped=True), moe.grouped_state(reference))
        experts = grouped.module.decoder.layers[0].mlp.experts
        assert type(experts).__name__ == "GroupedMLP", type(experts)
        want_loss, want = moe.loss_and_grads(reference, batch)
        got_loss, got = moe.loss_and_grads(grouped, batch)
        return want_loss, got_loss, want, moe.sequential_grads(got, grouped.config), used
    finally:
        me.destroy_distributed()


def test_grouped_mlp_equals_sequential_mlp():
    from harness import stand_in_moe as moe

    if not moe.has_legacy_grouped_mlp():
        pytest.skip("megatron-core >= 0.19 has no legacy GroupedMLP (grouped_gemm is not used)")
    results = me.run_workers(_grouped_mlp_worker, world_size=2, timeout=120)
    print("\nGroupedMLP (grouped_gemm stand-in) vs SequentialMLP, ep=2, alltoall, bfloat16")
    for rank, (want_loss, got_loss, want, got, used) in enumerate(results):
        assert used == "megatron_dualpipe.cpu.stand_ins.grouped_gemm.ops", used
        print(f"  rank {rank}: loss {got_loss:.6f} vs {want_loss:.6f} (diff {abs(got_loss - want_loss):.2e})")
        assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss)
        moe.compare(f"rank {rank} gradients", got, want, rtol=1e-2)

"""``grouped_gemm.ops.gmm``: the grouped product with autograd, as ``GroupedMLP`` calls it.

The backward is two more grouped products, as the library computes it: the input gradient is
``grad`` times each group's ``b`` with the opposite ``trans_b``, the weight gradient the per-group
``a_i.T @ grad_i`` (``grad_i.T @ a_i`` when ``trans_b``). Like the library, the forward refuses a
call where every group is empty (``GroupedMLP`` takes a plain matmul path then).
"""
from __future__ import annotations

import torch

from . import backend


class GroupedGemm(torch.autograd.Function):
    """Forward ``backend.gmm(a, b, batch_sizes, trans_b)``; backward by grouped products."""

    @staticmethod
    def forward(ctx, a, b, batch_sizes, trans_b):
        assert torch.count_nonzero(batch_sizes) != 0, "Input batch_sizes should not be all zeros!"
        ctx.save_for_backward(a, b, batch_sizes)
        ctx.trans_b = trans_b
        return backend.gmm(a, b, batch_sizes, trans_a=False, trans_b=trans_b)

    @staticmethod
    def backward(ctx, grad):
        a, b, batch_sizes = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = backend.gmm(grad, b, batch_sizes, trans_a=False, trans_b=not ctx.trans_b)
        if ctx.needs_input_grad[1]:
            lhs, rhs = (grad, a) if ctx.trans_b else (a, grad)
            grad_b = backend.gmm(lhs, rhs, batch_sizes, trans_a=True, trans_b=False)
        return grad_a, grad_b, None, None


def gmm(a, b, batch_sizes, trans_b=False):
    """``a`` grouped by ``batch_sizes`` (int64 on the CPU) times ``b[i]`` (``b[i].T`` with ``trans_b``)."""
    return GroupedGemm.apply(a, b, batch_sizes, trans_b)

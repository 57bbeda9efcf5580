"""The GEMMs of Linear, LayerNormLinear and GroupedLinear, and where their weight gradients go.

One autograd function for one GEMM or a group of them (row splits of the input, one weight each). Its
backward computes the input gradient and hands each weight gradient on as TE's does:

* now, or deferred (``plan.store``, the module's queue, when ``delay_wgrad_compute`` is on): the work is
  ``dW_i = dY_i^T X_i`` (and, when the bias is added inside the GEMM and no autocast is on, the bias
  gradient with it: TE fuses it into the weight-gradient GEMM, so a deferred backward defers it too);
* with ``fuse_wgrad_accumulation`` into ``weight.main_grad`` (added, or copied for the first micro-batch
  and for ``overwrite_main_grad`` weights), computed in ``main_grad``'s dtype; autograd then gets
  megatron's dummy gradient when the weight has ``grad_added_to_main_grad`` (set True), else None;
* without it, to autograd in B (``param.grad`` accumulates, hooks run) or, deferred, by
  ``backward_dw()``, which assigns ``param.grad`` (:mod:`.base`); autograd gets None in B.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence

import torch

from ._common import WeightGradStore
from .base import get_dummy_wgrad


class WeightGrads(NamedTuple):
    """Result of one backward's weight-gradient work: per GEMM the weight and bias gradient (or None)."""

    wgrads: List[Optional[torch.Tensor]]
    bgrads: List[Optional[torch.Tensor]]


@dataclass
class GemmPlan:
    """What the module decided at forward for this call."""

    splits: Optional[List[int]]  # rows of the input per GEMM; None: one GEMM
    bias_in_gemm: bool  # the bias is added inside (else returned to the caller or added after a reduction)
    fuse_wgrad_accumulation: bool
    accumulate: bool  # into main_grad (False: the first micro-batch, or overwrite_main_grad)
    store: Optional[WeightGradStore]  # the module's queue when deferring
    bias_grad_in_b: bool  # under the autocast TE computes the bias gradient in B, unfused


def accumulate_flag(fuse: bool, is_first_microbatch: Optional[bool], weight: torch.Tensor) -> bool:
    """TE: accumulate into main_grad unless this is the first micro-batch or the weight overwrites it."""
    accumulate = fuse and not is_first_microbatch if is_first_microbatch is not None else fuse
    return accumulate and not getattr(weight, "overwrite_main_grad", False)


def _split(x: torch.Tensor, splits: Optional[Sequence[int]]) -> List[torch.Tensor]:
    return [x] if splits is None else list(torch.split(x, list(splits)))


def _join(parts: List[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _WeightGradWork:
    """The weight-gradient GEMMs of one backward, run in B or later by ``backward_dw``."""

    def __init__(self, main_grads: List[Optional[torch.Tensor]], accumulate: bool, with_bias: bool) -> None:
        self.main_grads, self.accumulate, self.with_bias = main_grads, accumulate, with_bias

    @torch.no_grad()  # backward_dw runs outside autograd's backward: no graph of the GEMMs (TE's are C++)
    def __call__(self, xs: List[torch.Tensor], dys: List[torch.Tensor]) -> WeightGrads:
        wgrads, bgrads = [], []
        for x, dy, main_grad in zip(xs, dys, self.main_grads):
            if main_grad is None:
                wgrads.append(dy.t().matmul(x))
            else:
                dw = dy.t().to(main_grad.dtype).matmul(x.to(main_grad.dtype))
                main_grad.add_(dw) if self.accumulate else main_grad.copy_(dw)
                wgrads.append(main_grad)
            bgrads.append(dy.sum(dim=0) if self.with_bias else None)
        return WeightGrads(wgrads, bgrads)


def _autograd_wgrad(weight: torch.Tensor, wgrad: Optional[torch.Tensor], plan: GemmPlan) -> Optional[torch.Tensor]:
    """What autograd receives for ``weight`` in B (TE's 'handle custom DDP from mcore')."""
    if not plan.fuse_wgrad_accumulation:
        return wgrad
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return get_dummy_wgrad(list(weight.main_grad.shape), weight.dtype,
                           zero=getattr(weight, "zero_out_wgrad", False))


class Gemms(torch.autograd.Function):
    """``out = cat_i(X_i W_i^T (+ b_i))``; inputs: x2d, plan, n, n weights, then n biases if in the GEMM."""

    @staticmethod
    def forward(ctx, x2d, plan: GemmPlan, n: int, *params):
        weights, biases = params[:n], params[n:]
        ws = [w.to(x2d.dtype) for w in weights]
        outs = [x.matmul(w.t()) for x, w in zip(_split(x2d, plan.splits), ws)]
        if biases:
            outs = [o + b.to(x2d.dtype) for o, b in zip(outs, biases)]
        ctx.plan, ctx.n, ctx.weights = plan, n, list(weights)
        ctx.save_for_backward(x2d, *ws)
        return _join(outs)

    @staticmethod
    def backward(ctx, dy):
        plan, n = ctx.plan, ctx.n
        x2d, *ws = ctx.saved_tensors
        dys = _split(dy.reshape(-1, dy.shape[-1]).contiguous(), plan.splits)
        xs = _split(x2d, plan.splits)
        dx = _join([g.matmul(w) for g, w in zip(dys, ws)]) if ctx.needs_input_grad[0] else None
        with_bias = plan.bias_in_gemm
        if not any(ctx.needs_input_grad[3:3 + n]):
            bgrads = [g.sum(dim=0) for g in dys] if with_bias else []
            return (dx, None, None, *([None] * n), *bgrads)
        main_grads = [w.main_grad if plan.fuse_wgrad_accumulation else None for w in ctx.weights]
        work = _WeightGradWork(main_grads, plan.accumulate, with_bias and not plan.bias_grad_in_b)
        if plan.store is not None:
            plan.store.put([xs, dys], work)
            now = WeightGrads([None] * n, [None] * n)
        else:
            now = work(xs, dys)
        wgrads = [_autograd_wgrad(w, g, plan) for w, g in zip(ctx.weights, now.wgrads)]
        if not with_bias:
            bgrads = []
        elif plan.bias_grad_in_b:
            bgrads = [g.sum(dim=0) for g in dys]
        else:
            bgrads = now.bgrads
        return (dx, None, None, *wgrads, *bgrads)

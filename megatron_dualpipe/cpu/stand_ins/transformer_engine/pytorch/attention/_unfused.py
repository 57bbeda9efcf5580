"""Attention as TE's unfused backend computes it: ``softmax(scale * Q K^T + bias, masked) V``.

Masked scores become -10000 before the softmax (TE's and megatron-core's ``attention_mask_func``), so the
result equals megatron's local ``DotProductAttention`` on the same inputs; grouped-query heads are
repeated; dropout runs inside the RNG tracker's fork when one was given.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

MASKED = -10000.0


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: Optional[torch.Tensor],
              bias: Optional[torch.Tensor], bias_type: str, dropout: float, training: bool,
              dropout_ctx: Callable = nullcontext, want_max_logit: bool = False
              ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``q``: ``[sq, b, h, d]``, ``k``/``v``: ``[sk, b, g, d]`` -> (``[sq, b, h * dv]``, per-head max logit).

    The GEMMs in the unfused backends' layout (``[b * h, sq, sk]``, the scale as baddbmm's alpha) and the
    softmax in FP32, so that BF16 rounds as megatron's local attention does too."""
    sq, b, h, dk = q.shape
    sk, dv = k.shape[0], v.shape[-1]
    if k.shape[2] != h:
        k = k.repeat_interleave(h // k.shape[2], dim=2)
        v = v.repeat_interleave(h // v.shape[2], dim=2)
    qm = q.reshape(sq, b * h, dk).transpose(0, 1)  # [b * h, sq, d]
    km = k.reshape(sk, b * h, dk).permute(1, 2, 0)  # [b * h, d, sk]
    if bias_type == "pre_scale_bias":
        scores = (torch.bmm(qm, km).view(b, h, sq, sk) + bias) * scale
    else:
        scores = torch.baddbmm(qm.new_empty(b * h, sq, sk), qm, km, beta=0.0, alpha=scale).view(b, h, sq, sk)
        if bias_type == "post_scale_bias":
            scores = scores + bias
    scores = scores.float()
    if mask is not None:
        scores = scores.masked_fill(mask, MASKED)
    max_logit = torch.amax(scores.detach(), dim=(0, 2, 3)).to(q.dtype) if want_max_logit else None
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    with dropout_ctx():
        probs = F.dropout(probs, p=dropout, training=training)
    out = torch.bmm(probs.view(b * h, sq, sk), v.reshape(sk, b * h, dv).transpose(0, 1))  # [b * h, sq, dv]
    return out.view(b, h, sq, dv).permute(2, 0, 1, 3).reshape(sq, b, h * dv), max_logit

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
    """``q``: ``[sq, b, h, d]``, ``k``/``v``: ``[sk, b, g, d]`` -> (``[sq, b, h * dv]``, per-head max logit)."""
    sq, b, h, _ = q.shape
    if k.shape[2] != h:
        k = k.repeat_interleave(h // k.shape[2], dim=2)
        v = v.repeat_interleave(h // v.shape[2], dim=2)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    if bias_type == "pre_scale_bias":
        scores = (torch.matmul(qb, kb.transpose(-1, -2)) + bias) * scale
    else:
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale
        if bias_type == "post_scale_bias":
            scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(mask, MASKED)
    max_logit = torch.amax(scores.detach(), dim=(0, 2, 3)) if want_max_logit else None
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    with dropout_ctx():
        probs = F.dropout(probs, p=dropout, training=training)
    out = torch.matmul(probs, vb)  # [b, h, sq, dv]
    return out.permute(2, 0, 1, 3).reshape(sq, b, h * v.shape[-1]), max_logit

"""Which keys each query may attend to, as TE's unfused attention builds it (True = masked out).

``causal`` aligns the diagonal top-left (query ``i`` sees keys ``<= i``), ``causal_bottom_right`` and the
window of the non-causal types bottom-right (``<= i + sk - sq``). A sliding window ``(left, right)`` keeps
keys in ``[i + off - left, i + off + right]``; -1 is unbounded. ``arbitrary`` uses the given mask, to which
the window is added.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

MASK_TYPES = ("no_mask", "causal", "causal_bottom_right", "arbitrary")


def canonical_mask_type(attn_mask_type: str) -> str:
    kind = attn_mask_type.replace(",", "_")
    return "padding_causal" if kind == "causal_padding" else kind


def full_mask(sq: int, sk: int, attn_mask_type: str, window_size: Optional[Tuple[int, int]],
              attention_mask: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """Boolean ``[..., sq, sk]`` mask, or None when every query sees every key."""
    causal = "causal" in attn_mask_type
    left, right = window_size if window_size is not None else (-1, -1)
    if causal:
        right = 0
    given = attention_mask if attn_mask_type == "arbitrary" else None
    if left < 0 and right < 0:
        return given
    offset = 0 if attn_mask_type == "causal" else sk - sq
    q = torch.arange(sq, device=device).view(sq, 1) + offset
    k = torch.arange(sk, device=device).view(1, sk)
    mask = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        mask |= k > q + right
    if left >= 0:
        mask |= k < q - left
    mask = mask.view(1, 1, sq, sk)
    return mask if given is None else mask | given

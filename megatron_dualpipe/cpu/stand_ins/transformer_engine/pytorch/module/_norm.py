"""The normalisation of TE's LayerNorm, RMSNorm and LayerNormLinear, in torch's own kernels.

TE normalises in FP32 and returns the input's dtype; ``torch.nn.functional.layer_norm`` / ``rms_norm``
do the same on the CPU and are what megatron-core's local spec runs (``WrappedTorchNorm``), so the two
specs agree to the bit on the same weights. ``zero_centered_gamma`` scales by ``1 + weight``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def normalize(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
              normalization: str, zero_centered_gamma: bool) -> torch.Tensor:
    """``normalization`` of ``x`` over its last dimension with the affine ``weight`` (and ``bias``)."""
    gamma = (weight + 1 if zero_centered_gamma else weight).to(x.dtype)
    shape = (x.shape[-1],)
    if normalization == "LayerNorm":
        return F.layer_norm(x, shape, gamma, bias.to(x.dtype) if bias is not None else None, eps)
    if normalization == "RMSNorm":
        return F.rms_norm(x, shape, gamma, eps)
    raise ValueError(f"Unsupported normalization type {normalization!r} (LayerNorm or RMSNorm)")

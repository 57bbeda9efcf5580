"""``Fp8Padding`` / ``Fp8Unpadding``: pad each expert's rows to the quantized GEMMs' alignment and back.

megatron-core's ``TEGroupedMLP`` wraps its experts in them whenever FP8 or FP4 is configured, so they run
on the CPU too: zero rows appended to each split (to a multiple of ``align_size``, 16 by default as in TE
for FP8; 32 under an MXFP8 recipe, 64 under NVFP4) and removed again afterwards, with the gradients following.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..quantization import FP8GlobalStateManager


def _alignment(align_size: Optional[int]) -> int:
    if align_size is not None:
        return align_size
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    return 32 if recipe.mxfp8() else 64 if recipe.nvfp4() else 16


def _padded(splits: List[int], align: int) -> List[int]:
    return [(m + align - 1) // align * align for m in splits]


class Fp8Padding(torch.nn.Module):
    """``forward(inp, m_splits) -> (padded inp, padded m_splits)``."""

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> Tuple[torch.Tensor, List[int]]:
        padded = _padded(list(m_splits), _alignment(self.align_size))
        parts = []
        for part, m, p in zip(torch.split(inp, list(m_splits)), m_splits, padded):
            parts += [part, part.new_zeros((p - m,) + tuple(part.shape[1:]))]
        return torch.cat(parts) if parts else inp, padded


class Fp8Unpadding(torch.nn.Module):
    """``forward(inp, m_splits) -> inp`` without the rows ``Fp8Padding`` added to each split."""

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> torch.Tensor:
        padded = _padded(list(m_splits), _alignment(self.align_size))
        parts = [part[:m] for part, m in zip(torch.split(inp, padded), m_splits)]
        return torch.cat(parts) if parts else inp

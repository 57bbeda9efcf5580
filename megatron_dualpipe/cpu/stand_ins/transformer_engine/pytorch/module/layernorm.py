"""``transformer_engine.pytorch.LayerNorm`` and ``RMSNorm`` (megatron-core's ``TENorm``)."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from ._norm import normalize
from .base import cpu_device


class _Norm(torch.nn.Module):
    """Shared by both norms: TE's arguments (``hidden_size`` and ``params_dtype`` being the old names of
    ``normalized_shape`` and ``dtype``), parameters ``weight`` (and ``bias``), each marked
    ``sequence_parallel`` when the argument is given (megatron then sums their gradients over TP)."""

    normalization = ""

    def __init__(self, normalized_shape: Union[Iterable[int], int, None] = None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, hidden_size: Optional[int] = None,
                 device: Any = None, dtype: Optional[torch.dtype] = None, sm_margin: Any = 0) -> None:
        super().__init__()
        if (normalized_shape is None) == (hidden_size is None):
            raise RuntimeError("Give exactly one of `normalized_shape` and `hidden_size` (deprecated)")
        shape = normalized_shape if normalized_shape is not None else hidden_size
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = dtype or params_dtype or torch.get_default_dtype()
        self.eps, self.zero_centered_gamma, self.sequence_parallel = eps, zero_centered_gamma, sequence_parallel
        self._sm_margins = {"forward": 0, "backward": 0, "inference": 0}
        kw = {"device": cpu_device(device), "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(shape, **kw))
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(shape, **kw))
        if kw["device"].type != "meta":
            self.reset_parameters()

    def reset_parameters(self, defer_init: Optional[bool] = None) -> None:
        if defer_init:
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.normalization == "LayerNorm":
                self.bias.zero_()
        if self.sequence_parallel is not None:
            for param in self.parameters():
                param.sequence_parallel = self.sequence_parallel

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return normalize(inp, self.weight, getattr(self, "bias", None), self.eps, self.normalization,
                         self.zero_centered_gamma)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        pass


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    normalization = "RMSNorm"

"""``transformer_engine.pytorch.tensor``: the quantized tensor classes megatron-core tests parameters against.

No tensor of the stand-in is ever quantized (the autocast is a no-op for the numerics), so these classes
exist for ``isinstance`` checks and are never instantiated.
"""
import torch


class QuantizedTensorStorage:
    """Base of TE's quantized storages."""


class QuantizedTensor(torch.Tensor):
    """Base of TE's quantized tensors (``fp8_utils.is_float8tensor`` checks against it)."""


class Float8Tensor(QuantizedTensor):
    """Per-tensor scaled FP8 (delayed and current scaling)."""

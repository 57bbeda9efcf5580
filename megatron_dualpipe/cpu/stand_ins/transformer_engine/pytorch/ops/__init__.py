"""``transformer_engine.pytorch.ops``: TE's op fuser, which the stand-in does not have.

megatron-core 0.16.1 names ``te.pytorch.ops.Sequential`` and ``FusibleOperation`` in annotations that
are evaluated when ``extensions/transformer_engine.py`` is imported, so those two exist (and refuse to be
built); every other op is absent with a message saying why (an ``AttributeError``, so that megatron's
``from transformer_engine.pytorch.ops import ...`` probes fall back as without TE). The op fuser is what
``use_transformer_engine_op_fuser`` and ``use_te_activation_func`` select: leave them off on the CPU.
"""
from __future__ import annotations

from typing import Any

import torch

from ..module.base import refuse


class FusibleOperation(torch.nn.Module):
    """Base of TE's fusible ops (not available on the CPU)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse(True, f"te.pytorch.ops.{type(self).__name__} (the op fuser: use_transformer_engine_op_fuser, "
                     "use_te_activation_func)")


class Sequential(FusibleOperation):
    """A fused sequence of ops (not available on the CPU)."""


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"Transformer Engine stand-in (CPU mode): te.pytorch.ops.{name} is not available "
                         "(the op fuser: use_transformer_engine_op_fuser, use_te_activation_func)")

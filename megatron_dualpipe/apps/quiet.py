"""Silence the warnings megatron-core prints on every run without Transformer Engine or Apex
(seven per process, none asking anything of the user: megatron-core falls back to its local layers
and torch's optimizers, which the CPU mode wants). Callers print one line instead (:data:`SUMMARY`).
"""
from __future__ import annotations

import re
import warnings

#: Beginnings of the known harmless messages, and why each is harmless.
KNOWN_WARNINGS = (
    ("Transformer Engine and Apex are not installed",
     "megatron-core falls back to its local fused-op implementations and torch's optimizers"),
    ("Apex is not installed. Falling back to Torch Norm",
     "the local layer spec uses torch's LayerNorm"),
    ("full scope is deprecated",
     "raised by TransformerConfig's own default cuda_graph_scope; CUDA graphs are off"),
    ("absl.logging is not installed",
     "megatron-core 0.19's hyper_comm_grid logs through the standard logging module instead"),
)

#: The one line printed in place of the silenced warnings.
SUMMARY = ("no Transformer Engine / Apex: megatron-core's local layers and torch's optimizers "
           "(their fallback warnings are silenced)")


def silence_known_warnings() -> None:
    """Ignore the :data:`KNOWN_WARNINGS` in this process (idempotent)."""
    for start, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(start))

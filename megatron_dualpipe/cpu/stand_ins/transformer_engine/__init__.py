"""Stand-in for NVIDIA Transformer Engine (``import transformer_engine``) in the CPU mode.

Transformer Engine's PyTorch layers run only on NVIDIA GPUs, so without it megatron-core takes its local
path and the plugin's Transformer Engine path (``get_gpt_layer_with_transformer_engine_spec``,
``delay_wgrad_compute`` / ``backward_dw``) would never run on a CPU. This package keeps what megatron-core's
``extensions/transformer_engine.py`` uses of TE's PyTorch API: the layers with plain-torch numerics on the
CPU, TE's contract for what a backward computes, defers (a first-in first-out store per module) and
accumulates where (``.grad``, ``main_grad``), the low-precision autocast and its recipes (a no-op for the
numerics: :mod:`.pytorch.quantization`), the RNG tracker and activation checkpointing.

``stand_ins.install()`` hands it out under the library's name, only while the CPU mode is on and only where
the real library is absent. Its version (:mod:`._version`) follows the megatron-core installed next to it.
"""
from . import common, pytorch  # noqa: F401  (TE's own __init__ imports both)
from ._version import claimed_version

__version__ = claimed_version()

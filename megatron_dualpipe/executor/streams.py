"""Where ``Work.wait()`` blocks: the host (gloo, CPU tensors) or the current stream (NCCL).

Every "if on an accelerator" decision goes through :func:`waits_order_stream`, so that one switch,
:func:`emulating_stream_waits`, runs all the accelerator branches on the CPU in the tests.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_EMULATED = threading.local()


def waits_order_stream(t: torch.Tensor) -> bool:
    """True where ``Work.wait()`` on ``t`` makes the stream wait (an accelerator, or its CPU emulation)."""
    return bool(getattr(_EMULATED, "on", False)) or t.device.type != "cpu"


@contextlib.contextmanager
def emulating_stream_waits():
    """Take the accelerator branches with CPU tensors (this thread), with ``stream_emulation``'s works."""
    before = getattr(_EMULATED, "on", False)
    _EMULATED.on = True
    try:
        yield
    finally:
        _EMULATED.on = before

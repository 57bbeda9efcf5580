"""Where ``Work.wait()`` blocks: the host (gloo, CPU tensors) or the current stream (NCCL).

Every "if on an accelerator" decision of the package goes through :func:`waits_order_stream`, so
that one switch, :func:`emulating_stream_waits` (see :mod:`.stream_emulation`), runs all the
accelerator branches on the CPU in the tests. On an accelerator a ``wait()`` returns at once
and makes the current stream wait; everything issued later on that stream (compute, and every
collective or P2P batch, which starts after the stream's work before it) waits too. The host
runs on, so deadlines there are kept by polling ``is_completed()``.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_EMULATED = threading.local()


def waits_order_stream(t: torch.Tensor) -> bool:
    """True where a collective's ``Work.wait()`` on ``t`` makes the stream wait (an accelerator,
    or the CPU emulation of one), False where it blocks the host."""
    return bool(getattr(_EMULATED, "on", False)) or t.device.type != "cpu"


@contextlib.contextmanager
def emulating_stream_waits():
    """Take the accelerator branches with CPU tensors (this thread). Only meaningful together
    with works that behave like NCCL's (``stream_emulation.emulate_nccl_works``)."""
    before = getattr(_EMULATED, "on", False)
    _EMULATED.on = True
    try:
        yield
    finally:
        _EMULATED.on = before

"""``deep_ep.utils``: ``EventHandle`` and ``EventOverlap``, as megatron-core imports them.

On the GPU an ``EventHandle`` is a CUDA event recorded on a stream and ``current_stream_wait``
makes the current stream wait for it. The CPU finishes every operation before it returns, so an
event here is complete from the moment it exists and waiting for it returns at once; what stays
is the contract around them (``EventOverlap.current_stream_wait`` needs an event, the ``with``
form, ``extra_tensors`` kept alive).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


class EventHandle:
    """A completed event: made on the "current stream", which on the CPU has nothing pending."""

    def __init__(self) -> None:
        self.completed = True

    def current_stream_wait(self) -> None:
        """Nothing to wait for: the operation this event follows has finished."""


class EventOverlap:
    """An optional :class:`EventHandle` and the tensors that must live until it completes."""

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

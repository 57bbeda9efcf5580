"""``transformer_engine.pytorch.module._common``: the per-module store of deferred weight gradients.

With ``delay_wgrad_compute=True`` a TE layer's backward computes the input gradient only and puts the
weight-gradient work of that backward at the back of its module's queue; ``backward_dw()`` takes the
oldest entry and runs it. One queue per module, first in first out, as TE's ``WeightGradStore``: a
schedule matches every backward of a module with exactly one ``backward_dw()``, in the same order.
``context`` is a ``queue.Queue`` as in TE (the plugin reads ``context.qsize()``).
"""
from __future__ import annotations

import queue
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist


class WeightGradStore:
    """Deferred weight-gradient work of one module: ``put`` in backward, ``pop`` in ``backward_dw``."""

    def __init__(self, delay_wgrad_compute: bool = False, ub_bulk_wgrad: bool = False) -> None:
        if delay_wgrad_compute and ub_bulk_wgrad:
            raise AssertionError("ub_bulk_wgrad is not supported when enabling delay_wgrad_compute")
        self.context = queue.Queue() if delay_wgrad_compute else None
        self.enabled = bool(delay_wgrad_compute)

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def enable_delay_wgrad_compute(self) -> None:
        self.enabled = True
        if self.context is None:
            self.context = queue.Queue()

    def disable_delay_wgrad_compute(self) -> None:
        self.enabled = False

    def put(self, tensor_list: Sequence[Any], func: Callable[..., Any]) -> None:
        """Queue ``func(*tensor_list)`` (the weight-gradient GEMMs of one backward)."""
        assert self.enabled, "delay_wgrad_compute is not enabled"
        self.context.put((list(tensor_list), func))

    def pop(self) -> Tuple[Any, List[Any]]:
        """Run the oldest queued work: (its result, its tensors). An empty queue raises, as in TE."""
        assert self.enabled, "delay_wgrad_compute is not enabled"
        if self.context.qsize() > 0:
            tensor_list, func = self.context.get()
            return func(*tensor_list), tensor_list
        where = f"rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else \
            "No distributed environment detected."
        raise RuntimeError(f"Pop empty queue. {where}")

    def empty(self) -> bool:
        return self.context is None or self.context.empty()

    def size(self) -> int:
        return self.context.qsize() if self.context is not None else 0

    def assert_empty(self) -> None:
        assert self.enabled, "delay_wgrad_compute is not enabled"
        assert self.context.empty(), f"Queue is not empty ({self.context.qsize()} entries)"


def noop_cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The tensors as one (TE avoids a copy when they are adjacent views; a copy is equal)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim=dim)

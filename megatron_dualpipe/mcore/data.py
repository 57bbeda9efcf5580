"""Direction-aware data: which micro-batch of the global batch each direction reads.

Megatron hands the schedule one data iterator per rank (``None`` where it reads no data), split here by the
schedule's ``global_index`` / ``is_fake``. :class:`MicrobatchSource` reads lazily and in order, so a rank reads
exactly what its ``forward_step_func`` asks for, each at most once.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional


class MicrobatchSource:
    """Lazily buffers an iterator so that micro-batch ``g`` can be asked for in any order."""

    def __init__(self, iterator: Optional[Iterator[Any]]):
        self.iterator = iterator
        self.buffer: List[Any] = []
        self.reads = 0

    def get(self, g: int) -> Any:
        while len(self.buffer) <= g:
            self.buffer.append(next(self.iterator))
            self.reads += 1
        return self.buffer[g]

    def view(self, g: int) -> Optional["OneMicrobatch"]:
        """An iterator that yields micro-batch ``g`` once (None if there is no data here)."""
        return None if self.iterator is None else OneMicrobatch(self, g)


class OneMicrobatch:
    """What ``forward_step_func`` receives as its data iterator for one forward."""

    __slots__ = ("source", "g", "used")

    def __init__(self, source: MicrobatchSource, g: int):
        self.source, self.g, self.used = source, g, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.used:
            raise StopIteration(f"micro-batch {self.g} was already read by this forward")
        self.used = True
        item = self.source.get(self.g)
        # Megatron-LM core_v0.19.0's get_batch / get_batch_on_this_tp_rank write into the batch
        # dict (the first stage sets labels and loss_mask to None): each forward gets its own copy,
        # so a rank reading one micro-batch for two stages (DualPipeV's rank 0) sees it whole twice.
        return dict(item) if isinstance(item, dict) else item

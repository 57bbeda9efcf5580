"""Direction-aware data: which micro-batch of the global batch each direction reads.

Megatron hands the schedule one data iterator per rank (``None`` where the rank reads no
data), which yields the global batch's micro-batches in order, the same sequence on the first
and the last pipeline stage. We keep that: one iterator, split inside.

Global micro-batch ``g`` of an iteration with M real micro-batches goes to

* DualPipe: direction 0 for ``g < ceil(M/2)`` (micro-batch index ``g``), direction 1 for
  the rest (index ``g - ceil(M/2)``). Rank 0 reads direction 0's inputs and direction 1's
  labels; rank pp-1 the other way round; both read the same M samples.
* DualPipeV and 1F1B: direction 0, index ``g``.

:class:`MicrobatchSource` reads the underlying iterator lazily and in order, so a rank reads
exactly the micro-batches its ``forward_step_func`` asks for (middle stages read none, as
with 1F1B), each at most once, and a fake (padding) micro-batch reads nothing.
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
        return self.source.get(self.g)


def split_microbatches(schedule: str, real: int) -> List[int]:
    """Real micro-batches per direction for ``real`` micro-batches in the global batch."""
    if schedule == "dualpipe":
        first = (real + 1) // 2
        return [first, real - first]
    return [real]


def global_index(schedule: str, real: int, d: int, mb: int) -> int:
    """The global micro-batch index of micro-batch ``mb`` of direction ``d``."""
    if schedule == "dualpipe" and d == 1:
        return (real + 1) // 2 + mb
    return mb


def padded_microbatches(schedule: str, pp: int, real: int, forward_only: bool = False) -> int:
    """How many micro-batches the schedule runs (real plus fake) for ``real`` real ones.

    DualPipe needs an even count >= 2*pp, DualPipeV a count >= 2*pp. Training needs
    ``real >= pp`` (more padding than that wastes most of the pipeline); evaluation pads freely.
    """
    if schedule not in ("dualpipe", "dualpipev"):
        return real
    if real < pp and not forward_only:
        raise ValueError(
            f"{schedule} needs at least pp={pp} micro-batches per iteration, got {real}: raise "
            f"--global-batch-size to at least {pp} x micro-batch-size x data-parallel size "
            f"(with fewer than 2*pp={2 * pp} the executor pads with fake micro-batches)")
    if schedule == "dualpipe":
        return max(2 * pp, real + real % 2)
    return max(2 * pp, real)

"""The no-hang check: when one rank fails, every peer of its pipeline must stop within a bound with
an error that names a rank. :func:`attempt` records how one rank's run stopped; :func:`peers_stopped`
judges the peers' records (the tests and the selftest alike).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional


@dataclasses.dataclass
class Stop:
    """How one rank left a run: its error (``"Type: message"``, None if it finished), the seconds
    it spent in the run, and the wall-clock time it left (comparable across ranks of one machine)."""

    error: Optional[str]
    seconds: float
    at: float

    @property
    def kind(self) -> Optional[str]:
        return None if self.error is None else self.error.split(":", 1)[0]

    def first_line(self) -> str:
        return (self.error or "finished without an error").splitlines()[0]


def attempt(fn: Callable[[], object]) -> Stop:
    """Run ``fn`` and record how it ended (any exception is the record, not raised)."""
    t0 = time.monotonic()
    try:
        fn()
        error = None
    except Exception as e:  # noqa: BLE001 - what the check looks at
        error = f"{type(e).__name__}: {e}"
    return Stop(error, time.monotonic() - t0, time.time())


class InjectedFailure(RuntimeError):
    """The error a proof raises on purpose in one rank's forward."""


def raising_forward_step(forward_step, fails: bool, nth: int = 2):
    """``forward_step`` that raises :class:`InjectedFailure` at its ``nth`` call where ``fails``."""
    calls = [0]

    def step(data_iterator, model, *args, **kwargs):
        calls[0] += 1
        if fails and calls[0] == nth:
            raise InjectedFailure(f"injected failure in forward {nth} of this rank")
        return forward_step(data_iterator, model, *args, **kwargs)

    return step


def peers_stopped(stops: Dict[int, Stop], failing: int, limit_s: float, failed_at: Optional[float] = None) -> List[str]:
    """What is wrong with how the peers of rank ``failing`` stopped (empty: nothing): each must stop with an
    error naming a rank within ``limit_s`` of ``failed_at`` (wall-clock) where given, else of its start."""
    failures = []
    for rank, stop in sorted(stops.items()):
        if rank == failing:
            continue
        took = stop.seconds if failed_at is None else stop.at - failed_at
        if stop.error is None:
            failures.append(f"rank {rank} finished although rank {failing} failed")
        elif "rank" not in stop.error:
            failures.append(f"rank {rank} stopped with an error that names no rank: {stop.first_line()[:200]}")
        if took > limit_s:
            failures.append(f"rank {rank} took {took:.1f} s to stop, more than {limit_s:g} s")
    return failures

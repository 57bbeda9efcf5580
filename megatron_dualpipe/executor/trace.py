"""Timelines of real runs: when each action of each rank waited, started and ended.

Off by default; on with ``run_rank(..., trace=TraceRecorder(DIR))`` or ``MEGATRON_DUALPIPE_TRACE=DIR``
(``MEGATRON_DUALPIPE_TRACE_EVERY=N``: every N-th iteration). Each rank appends one JSON line per recorded call
to ``DIR/rank{global rank:05d}.jsonl``: the schedule, its actions, and per unit the seconds at which it began
waiting, started and ended (three clock reads per unit). ``megatron-dualpipe trace DIR`` draws them;
:class:`KeptRecorder` keeps the records in memory (the live advice). Standard library only.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .listeners import RunListener

ENV_DIR = "MEGATRON_DUALPIPE_TRACE"
ENV_EVERY = "MEGATRON_DUALPIPE_TRACE_EVERY"


class TraceRecorder:
    """Records one process's ``run_rank`` calls into ``directory`` (every ``every``-th call)."""

    def __init__(self, directory: str, every: int = 1):
        if every < 1:
            raise ValueError(f"trace every must be >= 1, got {every} (set {ENV_EVERY} to a positive integer)")
        os.makedirs(directory, exist_ok=True)
        self.directory, self.every = directory, every
        self.calls = 0

    def begin(self, program, rank: int, global_ranks: Sequence[int]) -> Optional["IterationRecord"]:
        """Start recording one ``run_rank`` call, or None if this call is skipped."""
        call = self.calls
        self.calls += 1
        if call % self.every:
            return None
        return IterationRecord(call, program, rank, list(global_ranks), self._write)

    def _write(self, line: dict) -> None:
        path = os.path.join(self.directory, f"rank{line['global_rank']:05d}.jsonl")
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")


class KeptRecorder:
    """Records every ``run_rank`` call into :attr:`records` (the files' dicts), with the ``perf_counter`` time
    each call's unit times count from in :attr:`origins`."""

    def __init__(self):
        self.records: List[dict] = []
        self.origins: List[float] = []

    def begin(self, program, rank: int, global_ranks: Sequence[int]) -> "IterationRecord":
        record = IterationRecord(len(self.origins), program, rank, list(global_ranks), self.records.append)
        self.origins.append(record.start)
        return record


class IterationRecord(RunListener):
    """One rank's timings of one ``run_rank`` call, a listener of the run; at its end they go to ``sink``."""

    def __init__(self, call: int, program, rank: int, global_ranks: List[int], sink: Callable[[dict], None]):
        self.call, self.program, self.rank, self.sink = call, program, rank, sink
        self.global_ranks = global_ranks
        self.wall_start = time.time()
        self.start = time.perf_counter()
        self.units: List[Tuple[Tuple[int, ...], float, float, float]] = []
        self._waited = self._started = 0.0

    def on_unit_waiting(self, unit: Tuple[int, ...]) -> None:
        self._waited = time.perf_counter()

    def on_unit_start(self, unit: Tuple[int, ...]) -> None:
        self._started = time.perf_counter()

    def on_unit_end(self, unit: Tuple[int, ...]) -> None:
        self.units.append((unit, self._waited, self._started, time.perf_counter()))

    def on_run_end(self) -> None:
        s = self.program.schedule
        g = self.global_ranks[self.rank] if self.rank < len(self.global_ranks) else self.rank
        line = {
            "schedule": s.name, "pp": s.pp, "microbatches": s.microbatches, "rank": self.rank, "global_rank": g,
            "pipeline": self.global_ranks, "call": self.call, "wall_start": self.wall_start,
            "actions": [a.to_json() for a in self.program.actions[self.rank]],
            "units": [[list(ix), round(w - self.start, 6), round(b - self.start, 6), round(e - self.start, 6)]
                      for ix, w, b, e in self.units],
        }
        self.sink(line)


def trace_from_env() -> Optional[TraceRecorder]:
    """The process's recorder for ``MEGATRON_DUALPIPE_TRACE`` (None when unset)."""
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return None
    try:
        every = int(os.environ.get(ENV_EVERY, "1"))
    except ValueError:
        raise ValueError(f"{ENV_EVERY} must be a positive integer, got {os.environ[ENV_EVERY]!r}") from None
    return _recorder(directory, every)


@functools.lru_cache(maxsize=None)
def _recorder(directory: str, every: int) -> TraceRecorder:
    return TraceRecorder(directory, every)


def op_medians(record: dict, *more: dict) -> Dict[str, float]:
    """Per op (``FB`` for a fused unit) the median duration in ms of the units of one or more recorded calls."""
    from ..schedule import Action

    spans: Dict[str, List[float]] = {}
    for rec in (record, *more):
        ops = [Action.from_json(a).op for a in rec["actions"]]
        for indices, _, started, ended in rec["units"]:
            key = "FB" if len(indices) == 2 else ops[indices[0]]
            spans.setdefault(key, []).append((ended - started) * 1e3)
    return {k: statistics.median(v) for k, v in spans.items()}


def slowest_costs(per_rank: Sequence[Dict[str, float]]):
    """The simulator's costs from the ranks' :func:`op_medians`: per op the largest (the slowest stage sets the
    pace); a full backward is ``BW``, or ``B`` + ``W`` when the schedule split it."""
    from ..schedule.actions import B, BW, F, W
    from ..schedule.simulate import Costs

    def slowest(key: str) -> Optional[float]:
        found = [m[key] for m in per_rank if key in m]
        return max(found) if found else None

    f, w, bw, b_only = slowest(F) or 0.0, slowest(W) or 0.0, slowest(BW), slowest(B)
    b = bw if bw is not None else (b_only + w if b_only is not None else 0.0)
    return Costs(f=f, b=max(b, w), w=w, fb=slowest("FB"))

"""Stage ``overlap``: how much of the MoE all-to-all DualPipe's fused F&B units hide (with ``--ep``).
:class:`NodeTimer` times every schedule node of one DualPipe iteration's fused units by swapping
megatron-core's ``stream_acquire_context`` (0.16: a module function, 0.19: a ``ScheduleNode`` method):
CUDA events, the host clock on the CPU (where the nodes run one after another, so the stage SKIPs).
Per rank: the ``moe_dispatch`` / ``moe_combine`` time inside the unit's compute nodes' time.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..proof import models
from .result import FAIL, PASS, SKIP, StageResult
from ..schedule.registry import DUALPIPE

NAME = "overlap"
COMM_NODES = ("moe_dispatch", "moe_combine")
Interval = Tuple[float, float]


def hidden_ms(comm: Sequence[Interval], compute: Sequence[Interval]) -> Tuple[float, float]:
    """(time of ``comm`` inside the union of ``compute``, total time of ``comm``), in the intervals' unit."""
    merged: List[List[float]] = []
    for s, e in sorted(compute):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    inside = sum(max(0.0, min(e, me) - max(s, ms)) for s, e in comm for ms, me in merged)
    return inside, sum(e - s for s, e in comm)


class NodeTimer:
    """Times the schedule nodes run inside fused F&B units (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.unit: Optional[int] = None  # the fused unit being run, None outside them
        self.units = 0
        self.node: List[str] = []  # names of the nodes being entered (innermost last)
        self.marks: List[Tuple[int, str, object, object]] = []  # (unit, node name, start, end)

    def _mark(self, stream):
        if not self.cuda:
            return time.perf_counter() * 1e3
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    @contextlib.contextmanager
    def _timing(self, stream, name: str) -> Iterator[None]:
        """Mark the node ``name`` running inside the block on ``stream`` (inside a fused unit only)."""
        start = self._mark(stream) if self.unit is not None else None
        try:
            yield
        finally:
            if start is not None:
                self.marks.append((self.unit, name, start, self._mark(stream)))

    @contextlib.contextmanager
    def _acquire(self, stream, event) -> Iterator[None]:
        """megatron-core 0.16's module function: wait, run on ``stream``, record."""
        event.wait(stream)
        try:
            with self._timing(stream, self.node[-1] if self.node else "?"):
                yield
        finally:
            event.record(stream)

    def intervals(self) -> Dict[int, Tuple[List[Interval], List[Interval]]]:
        """Per fused unit: (all-to-all intervals, compute intervals) in ms."""
        if self.cuda:
            torch.cuda.synchronize()
        if not self.marks:
            return {}
        origin = self.marks[0][2]

        def ms(mark) -> float:
            return origin.elapsed_time(mark) if self.cuda else mark - origin

        out: Dict[int, Tuple[List[Interval], List[Interval]]] = {}
        for unit, name, start, end in self.marks:
            comm, compute = out.setdefault(unit, ([], []))
            (comm if name in COMM_NODES else compute).append((ms(start), ms(end)))
        return out

    def _timed_method(self, original):
        """megatron-core >= 0.19: ``ScheduleNode.stream_acquire_context(self, name)`` is a method
        (wait, enter the node's stream ... record): mark inside it, where the node runs."""
        timer = self

        @contextlib.contextmanager
        def acquire(node, name=None):
            with original(node, name), timer._timing(node.stream, getattr(node, "name", "?")):
                yield
        return acquire

    @contextlib.contextmanager
    def installed(self) -> Iterator["NodeTimer"]:
        """Swaps (restored on exit): the node entry of megatron-core's schedule nodes, and the fused
        unit hook of :class:`OverlappedStageCompute`, whose calls number the units."""
        from megatron.core.pipeline_parallel import utils as pp_utils

        from ..mcore.overlap import OverlappedStageCompute

        from .. import hooks

        node_cls, stage_cls = pp_utils.ScheduleNode, OverlappedStageCompute
        timer = self
        swaps = []  # megatron-core's, through the hooks manifest (restored on exit)
        if hasattr(node_cls, "stream_acquire_context"):  # megatron-core >= 0.19
            swaps.append(hooks.entry("scoped", "ScheduleNode.stream_acquire_context")
                         .to(self._timed_method(node_cls.stream_acquire_context)))
        else:  # 0.16: a module function of (stream, event); the node's name from _forward/_backward
            def named(original):
                def run(node, *args):
                    timer.node.append(getattr(node, "name", type(node).__name__))
                    try:
                        return original(node, *args)
                    finally:
                        timer.node.pop()
                return run

            swaps += [hooks.entry("scoped", "stream_acquire_context").to(self._acquire),
                      hooks.entry("scoped", "ScheduleNode._forward").to(named(node_cls._forward)),
                      hooks.entry("scoped", "ScheduleNode._backward").to(named(node_cls._backward))]
        fused_hook = stage_cls.forward_backward

        def fused(compute, *args, **kwargs):
            timer.unit, timer.units = timer.units, timer.units + 1
            try:
                return fused_hook(compute, *args, **kwargs)
            finally:
                timer.unit = None

        # the project's own fused-unit hook is swapped directly (not Megatron's: not in the manifest)
        stage_cls.forward_backward = fused
        try:
            with hooks.scoped(*swaps):
                yield self
        finally:
            stage_cls.forward_backward = fused_hook


def run(ctx) -> Optional[dict]:
    if ctx.cfg.ep <= 1:
        return None
    spec = ctx.cfg.spec(moe=True)
    full = models.full_state_dict(spec)
    chunks = models.build(spec, DUALPIPE, full)
    m = 2 * ctx.cfg.pp
    models.run_iteration(spec, DUALPIPE, chunks, models.batches(spec, m, step=11), p2p_timeout=ctx.cfg.deadline_s)
    models.zero_grads(chunks)
    timer = NodeTimer(ctx.device)
    with timer.installed():
        models.run_iteration(spec, DUALPIPE, chunks, models.batches(spec, m, step=12),
                             p2p_timeout=ctx.cfg.deadline_s)
    per_unit = list(timer.intervals().values())
    hidden = [hidden_ms(comm, compute) for comm, compute in per_unit]
    return {"rank": ctx.rank, "coord": ctx.coord, "units": timer.units, "comm_nodes": sum(len(c) for c, _ in per_unit),
            "compute_nodes": sum(len(c) for _, c in per_unit), "hidden_ms": sum((h for h, _ in hidden), 0.0),
            "comm_ms": sum((t for _, t in hidden), 0.0)}


def judge(ctx, payloads: List[Optional[dict]]) -> StageResult:
    if ctx.cfg.ep <= 1:
        return StageResult(NAME, SKIP, "no --ep: the fused F&B units hide MoE all-to-all, which needs expert "
                                       "parallelism (--ep 2 or more)")
    details = [f"DualPipe, {ctx.cfg.spec(moe=True).label()}, M={2 * ctx.cfg.pp}, one iteration after a warm-up; "
               f"per rank: fused units, all-to-all nodes timed, all-to-all time inside the unit's compute"]
    fractions = [p["hidden_ms"] / p["comm_ms"] if p["comm_ms"] > 0 else None for p in payloads]
    for p, frac in zip(payloads, fractions):
        details.append(f"rank {p['rank']} (pp, tp, dp) = {tuple(p['coord'])}: {p['units']} fused units, "
                       f"{p['comm_nodes']} all-to-all and {p['compute_nodes']} compute nodes; all-to-all "
                       f"{p['comm_ms']:.3f} ms, of which {p['hidden_ms']:.3f} ms hidden"
                       f"{'' if frac is None else f' ({100 * frac:.0f}%)'}")
    numbers = {"ranks": payloads}
    if not ctx.cfg.gpu:
        recorded = sum(p["comm_nodes"] for p in payloads)
        return StageResult(NAME, SKIP, f"not measurable on the CPU: the combined step runs dispatch, combine and "
                                       f"compute one after another on one stream (recorded {recorded} all-to-all "
                                       f"nodes in {sum(p['units'] for p in payloads)} fused units, "
                                       f"{100 * max(f or 0.0 for f in fractions):.0f}% hidden)", details, numbers)
    measured = [f for f in fractions if f is not None]
    if not measured:
        return StageResult(NAME, FAIL, "no all-to-all node ran inside a fused unit: the combined step did not run",
                           details, numbers, hard=False)
    summary = (f"all-to-all hidden inside fused F&B units: {100 * min(measured):.0f}%-{100 * max(measured):.0f}% "
               f"per rank (mean {100 * sum(measured) / len(measured):.0f}%)")
    if max(measured) == 0.0:
        return StageResult(NAME, FAIL, "nothing hidden: " + summary, details, numbers, hard=False)
    return StageResult(NAME, PASS, summary, details, numbers)

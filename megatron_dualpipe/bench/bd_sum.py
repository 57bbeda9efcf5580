"""DualPipe's bd gradient sum in the benchmark (``--grad-mb``): how much of it an iteration shows.

The sum over the bd pair of every stage's two copies made DualPipe slower than 1F1B on 32 GPUs in
seed 002. Every chunk of a bidirectional schedule holds ``--grad-mb`` MiB of synthetic gradients,
summed by the code path training uses (``Program.sum_points``, ``executor.pair_sums.PairSums``:
none waited for before the schedule ends). Per rank: the *exposed* time (from the end of its last
action to its last sum's completion) beside the time the same sums take *alone*, started only after
the schedule (what an unoverlapped sum would add).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..executor.pair_sums import PairSums, action_key, issue_sum
from ..schedule.layout import BIDIRECTIONAL
from .synthetic import synchronize

_PAIR_GROUPS: Dict[int, Dict[int, object]] = {}


def pair_groups(world: int) -> Dict[int, object]:
    """{rank: its bd pair's group} for every rank; built once per world size (every rank creates
    every pair's group, in the same order, as ``new_group`` requires)."""
    if world not in _PAIR_GROUPS:
        groups = {}
        for r in range(world // 2):
            g = dist.new_group([r, world - 1 - r])
            groups[r] = groups[world - 1 - r] = g
        _PAIR_GROUPS[world] = groups
    return _PAIR_GROUPS[world]


class BdSums:
    """One rank's synthetic bd sums for one (schedule, M), told of every gradient action."""

    def __init__(self, program, rank: int, world: int, megabytes: float, device):
        actions, points = program.actions[rank], program.sum_points[rank]
        self._points: Dict[tuple, List[int]] = {}
        for i, c in points:
            if i < len(actions):
                self._points.setdefault(action_key(actions[i]), []).append(c)
        self._order = [c for _, c in points]
        self._group = pair_groups(world)[rank]
        n = max(1, int(megabytes * (1 << 20)) // 4)
        self._grads = [torch.zeros(n, dtype=torch.float32, device=device) for _ in range(2)]
        self.exposed_s: List[float] = []
        self.alone_s: List[float] = []
        self._reset()

    def _reset(self) -> None:
        self._sums = PairSums(self._points, lambda c: [self._grads[c]], self._group, in_place=lambda c: True,
                              describe=lambda c: f"synthetic bd sum of chunk {c}")

    def after_action(self, a) -> None:
        self._sums.after_action(a)

    def finish(self, timed: bool) -> None:
        """End of the iteration: issue what is left, wait for every sum; time what was exposed."""
        t0 = time.perf_counter()
        self._sums.finish(self._order)
        if timed:
            synchronize(self._grads[0].device)  # on a GPU the stream waited: the host measures it here
            self.exposed_s.append(time.perf_counter() - t0)
        self._reset()

    def time_alone(self, rounds: int = 3) -> None:
        """Both sums started only after the schedule (no overlap): median of ``rounds``."""
        times = []
        for _ in range(rounds):
            dist.barrier(group=self._group)
            t0 = time.perf_counter()
            for s in [issue_sum(c, [self._grads[c]], self._group, in_place=True) for c in self._order]:
                s.wait()
            synchronize(self._grads[0].device)
            times.append(time.perf_counter() - t0)
        self.alone_s = [statistics.median(times)]


def probe_ms(world: int, rank: int, megabytes: float, device, rounds: int = 7) -> Optional[float]:
    """One bd sum of ``megabytes`` with every pair summing at once, as at the end of a DualPipe iteration,
    in ms (median; the caller takes the slowest rank's); None without pairs or gradients."""
    if megabytes <= 0 or world % 2 or world < 2:
        return None
    group = pair_groups(world)[rank]
    grad = torch.zeros(max(1, int(megabytes * (1 << 20)) // 4), dtype=torch.float32, device=device)
    times = []
    for k in range(rounds + 2):
        dist.barrier()
        t0 = time.perf_counter()
        issue_sum(0, [grad], group, in_place=True).wait()  # the one bd-sum implementation
        synchronize(grad.device)
        if k >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bd_sums_for(program, rank: int, world: int, megabytes: float, device) -> Optional[BdSums]:
    """A :class:`BdSums` when the schedule keeps two copies of each stage and ``megabytes`` > 0."""
    if megabytes <= 0 or program.schedule.layout.kind != BIDIRECTIONAL or world % 2:
        return None
    return BdSums(program, rank, world, megabytes, device)

"""What every rank of the benchmark does: time the executor (and torch's schedules) on the
synthetic stages, and the latency of one point-to-point message. Each iteration starts with a
barrier; its time is the slowest rank's (:mod:`.report` combines the ranks' figures).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..executor.p2p import P2P
from ..executor.runner import TensorSpec, run_rank
from ..executor.trace import TraceRecorder
from ..schedule.lowering.program import build_program
from .bd_sum import bd_sums_for, probe_ms
from .synthetic import Spender, StageCosts, SyntheticCompute, synchronize


@dataclass(frozen=True)
class BenchConfig:
    schedules: Tuple[str, ...]
    microbatches: Dict[int, Tuple[int, ...]]  # pp -> M values
    costs: StageCosts
    mode: str = "sleep"
    matmul_size: int = 1024
    shape: Tuple[int, int] = (8, 1024)
    iters: int = 5
    warmup: int = 2
    peers: Tuple[str, ...] = ()
    timeout_s: float = 120.0
    trace_dir: Optional[str] = None
    per_channel: bool = False
    grad_mb: float = 0.0  # synthetic gradients per chunk summed over the bd pair (bench.bd_sum)
    param_gather_mb: float = 0.0  # synthetic parameters per chunk gathered over 2 replicas (bench.param_gather)


@dataclass
class RankRun:
    """One rank's figures for one (schedule, M), one entry per timed iteration."""

    wall_s: List[float] = field(default_factory=list)
    compute_s: List[float] = field(default_factory=list)
    p2p_s: List[float] = field(default_factory=list)
    peak_live: int = 0
    peak_in_flight: Optional[int] = None
    actions: int = 0
    bd_exposed_s: List[float] = field(default_factory=list)  # per timed iteration (bench.bd_sum)
    bd_alone_s: Optional[float] = None


class TimedP2P:
    """Wraps the executor's :class:`P2P` and adds up the time spent in its methods (posting
    and waiting), whatever the protocol calls them."""

    def __init__(self, inner: P2P):
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def half_round_trip_s(me: int, peer: int, buf: torch.Tensor, rounds: int, device, warmup: int = 2) -> float:
    """Half the median round trip of ``buf`` between ``me`` and ``peer`` (the lower rank sends first),
    in seconds; the median, because a loaded machine makes some round trips much longer."""
    trips = []
    for k in range(rounds + warmup):
        synchronize(device)
        t0 = time.perf_counter()
        if me < peer:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        synchronize(device)
        if k >= warmup:  # the first trips set up the connection
            trips.append(time.perf_counter() - t0)
    return statistics.median(trips) / 2


def p2p_latency_ms(rank: int, device, shape, rounds: int = 200) -> Optional[float]:
    """Half the median round-trip time of one tensor between ranks 0 and 1 (None on a single rank)."""
    if dist.get_world_size() < 2:
        return None
    out = None
    if rank in (0, 1):
        out = half_round_trip_s(rank, 1 - rank, torch.zeros(shape, device=device), rounds, device, warmup=10) * 1e3
    dist.barrier()
    return out


def _time_iterations(cfg: BenchConfig, device, one_iteration) -> List[float]:
    walls = []
    for it in range(cfg.warmup + cfg.iters):
        dist.barrier()
        t0 = time.perf_counter()
        one_iteration(it >= cfg.warmup)
        synchronize(device)
        if it >= cfg.warmup:
            walls.append(time.perf_counter() - t0)
    return walls


def run_project(cfg: BenchConfig, rank: int, world: int, device, spender: Spender, name: str, m: int) -> RankRun:
    program = build_program(name, world, m)
    spec = TensorSpec(tuple(cfg.shape), torch.float32, device)
    options = {}
    if cfg.per_channel:
        from ..executor.p2p import channel_groups, channels_of  # not in the executors before them

        options["channel_groups"] = channel_groups(list(range(world)), channels_of(program.plans))
    p2p = TimedP2P(P2P(None, list(range(world)), rank, timeout_s=cfg.timeout_s, **options))
    out = RankRun(actions=len(program.actions[rank]))
    recorder = TraceRecorder(os.path.join(cfg.trace_dir, f"{name}_pp{world}_m{m}")) if cfg.trace_dir else None
    sums = bd_sums_for(program, rank, world, cfg.grad_mb, device)

    def one(timed: bool) -> None:
        compute = SyntheticCompute(cfg.costs, spender, cfg.shape, on_grad=sums.after_action if sums else None)
        spender.start_iteration()
        p2p.seconds = 0.0
        # trace= only when recording: the benchmark also runs executors from before it existed
        stats = run_rank(program, rank, compute, p2p, spec, **({"trace": recorder} if recorder and timed else {}))
        if sums is not None:
            sums.finish(timed)
        if timed:
            out.compute_s.append(spender.busy_s)
            out.p2p_s.append(p2p.seconds)
            out.peak_live = max(out.peak_live, compute.peak_live)
            in_flight = getattr(stats, "peak_in_flight", None)
            if in_flight is not None:
                out.peak_in_flight = max(out.peak_in_flight or 0, in_flight)

    out.wall_s = _time_iterations(cfg, device, one)
    if sums is not None:
        sums.time_alone()
        out.bd_exposed_s, out.bd_alone_s = sums.exposed_s, sums.alone_s[0]
    return out


def run_torch(cfg: BenchConfig, rank: int, world: int, device, spender: Spender, name: str, m: int) -> RankRun:
    from .torch_peer import build_step

    step = build_step(name, rank, world, m, cfg.costs, spender, cfg.shape)
    out = RankRun()

    def one(timed: bool) -> None:
        spender.start_iteration()
        step()
        if timed:
            out.compute_s.append(spender.busy_s)

    out.wall_s = _time_iterations(cfg, device, one)
    return out


def overhead_probe_ms(cfg: BenchConfig, rank: int, world: int, device, spender: Spender) -> List[float]:
    """This rank's iteration times of the executor's 1F1B order at M=2pp on the bench's own stage
    costs, before any measured schedule: with the simulation of that run, what running a unit
    costs beyond its compute here (``report.unit_overhead_ms``: the executor, the P2P layer, and
    sleepers woken late on a loaded machine, which depends on the costs, hence the same ones)."""
    from dataclasses import replace

    from ..schedule.registry import EXECUTOR_1F1B

    probe = replace(cfg, iters=3, warmup=1, grad_mb=0.0, trace_dir=None)
    return [t * 1e3 for t in run_project(probe, rank, world, device, spender, EXECUTOR_1F1B, 2 * world).wall_s]


def worker(rank: int, world: int, device, cfg: BenchConfig) -> dict:
    """One rank's figures: latency, and a :class:`RankRun` per (runner, schedule, M)."""
    spender = Spender(cfg.mode, device, cfg.matmul_size)
    result = {"latency_ms": p2p_latency_ms(rank, device, cfg.shape), "runs": {},
              "overhead_probe_ms": overhead_probe_ms(cfg, rank, world, device, spender),
              "matmuls_per_ms": spender.per_ms, "device": str(device), "backend": dist.get_backend()}
    result["bd_probe_ms"] = probe_ms(world, rank, cfg.grad_mb, device)
    for m in cfg.microbatches[world]:
        for name in cfg.schedules:
            result["runs"][("project", name, m)] = run_project(cfg, rank, world, device, spender, name, m)
        for name in cfg.peers:
            result["runs"][("torch", name, m)] = run_torch(cfg, rank, world, device, spender, name, m)
    return result

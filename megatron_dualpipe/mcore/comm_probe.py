"""The links of a running job, timed for ``--dualpipe-advise``: the bd pair, data parallel, P2P.

The sums ``GradReduction`` issues overlap compute (and on an accelerator finish on a stream the host does not
watch), so the same collectives are timed once right after the measured iteration, on the same groups with
scratch buffers, at two sizes: the small one gives the latency, the difference the bandwidth (ring all-reduce:
2(n-1)/n x bytes / bandwidth + 2(n-1) latencies). Collective: every rank calls :func:`measure` at one point.
"""
from __future__ import annotations

import statistics
import time
from collections import namedtuple
from typing import Optional

import torch
import torch.distributed as dist

from ..costs.comm_cost import Link

SMALL, LARGE = 64 << 10, 16 << 20
ROUNDS = 5


def _timed(fn, device, group) -> float:
    """Median ms of ``fn`` over ROUNDS after one untimed call, each after a barrier on ``group``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    times = []
    for k in range(ROUNDS + 1):
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if k:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _fit(small_ms: float, large_ms: float, factor: float) -> Link:
    """The link whose cost ``factor x bytes / bandwidth + latency terms`` gives both timings."""
    per_byte = max(large_ms - small_ms, 1e-6) / (LARGE - SMALL)  # ms per byte, times factor
    bandwidth = factor / per_byte / 1e6  # GB/s
    return Link(bandwidth, max(0.0, small_ms - factor * SMALL / (bandwidth * 1e6)))


def all_reduce_link(group, device) -> Optional[Link]:
    """A ring all-reduce on ``group`` at two sizes; None for a group of one."""
    if group is None or dist.get_world_size(group) < 2:
        return None
    n = dist.get_world_size(group)
    bufs = {size: torch.zeros(size // 4, dtype=torch.float32, device=device) for size in (SMALL, LARGE)}
    t = {size: _timed(lambda b=b: dist.all_reduce(b, group=group), device, group) for size, b in bufs.items()}
    link = _fit(t[SMALL], t[LARGE], 2 * (n - 1) / n)
    return Link(link.bandwidth, link.latency / (2 * (n - 1)))


def p2p_link(group, device) -> Optional[Link]:
    """Every pipeline rank sends to the next and receives from the previous (a ring), at two sizes."""
    if group is None or dist.get_world_size(group) < 2:
        return None
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    nxt, prv = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]

    def ring(send, recv):
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group),
                                         dist.P2POp(dist.irecv, recv, prv, group)]):
            w.wait()

    t = {}
    for size in (SMALL, LARGE):
        send, recv = (torch.zeros(size // 4, dtype=torch.float32, device=device) for _ in range(2))
        t[size] = _timed(lambda s=send, r=recv: ring(s, r), device, group)
    return _fit(t[SMALL], t[LARGE], 1.0)


#: The job's measured links (None where not measured) and its data-parallel size.
Links = namedtuple("Links", "p2p bd dp dp_size")


def measure(pipeline_group, device, bidirectional: bool) -> Links:
    """Time the job's links (module docstring); collective over every rank of the job."""
    from megatron.core import parallel_state

    from . import bd_pairs

    p2p = p2p_link(pipeline_group, device)
    bd = all_reduce_link(bd_pairs.position().group, device) if bidirectional else None
    dp_group, dp_size = None, 1
    if parallel_state.model_parallel_is_initialized():
        dp_group = parallel_state.get_data_parallel_group()
        dp_size = dist.get_world_size(dp_group)
    dp = all_reduce_link(dp_group, device) if dp_size > 1 else None
    return Links(p2p, bd, dp, dp_size)

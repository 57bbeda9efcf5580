"""Batched point-to-point communication with a deadline.

One call of :meth:`P2P.exchange` is one ``batch_isend_irecv`` of a plan batch. Every wait has
a timeout; when it expires the error names this rank, the peers and what was being waited for,
so a stuck or dead peer never hangs the job silently.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("MEGATRON_DUALPIPE_P2P_TIMEOUT", "600"))


class P2PTimeoutError(RuntimeError):
    """A P2P batch did not complete in time, or failed because a peer went away."""


class P2P:
    """Sends and receives between pipeline ranks of one pipeline group.

    ``global_ranks[i]`` is the global rank of pipeline rank ``i``; peers are given as pipeline
    ranks. ``describe`` turns a transfer's label into words for error messages.
    """

    def __init__(self, group, global_ranks: Sequence[int], my_pp_rank: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.group = group
        self.global_ranks = list(global_ranks)
        self.rank = my_pp_rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s

    def first_collective(self, device) -> None:
        """One all-reduce on the pipeline group before its first batched P2P, with the same
        deadline: with NCCL, a group's first collective must involve all its ranks
        (``batch_isend_irecv``'s documented rule), and DualPipe's first batches involve only some.
        Call it once per group, on every rank of the group."""
        start = time.monotonic()
        try:
            work = dist.all_reduce(torch.zeros(1, device=device), group=self.group, async_op=True)
            if not work.wait(self.timeout):
                raise RuntimeError("wait returned False")
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            raise P2PTimeoutError(
                f"pipeline rank {self.rank} (global {dist.get_rank()}) before its first point-to-point batch: the "
                f"all-reduce on the pipeline group (global ranks {self.global_ranks}) did not complete "
                f"({elapsed:.1f} s, timeout {self.timeout_s:g} s): a pipeline rank has not entered the schedule, or "
                f"exited; look at the other ranks' logs. Underlying error: {e}") from e

    def exchange(self, sends: List[Tuple[int, torch.Tensor, object]], recvs: List[Tuple[int, torch.Tensor, object]],
                 where: str, describe: Callable[[object], str] = str) -> None:
        """Post all ``sends`` and ``recvs`` ((peer pp rank, tensor, label)) as one batch and wait."""
        if not sends and not recvs:
            return
        ops = [dist.P2POp(dist.isend, t, self.global_ranks[p], self.group) for p, t, _ in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_ranks[p], self.group) for p, t, _ in recvs]
        start = time.monotonic()
        try:
            reqs = dist.batch_isend_irecv(ops)
            for req in reqs:
                # One deadline for the whole batch (not timeout_s per request); gloo honours it.
                # At least 1 ms: a zero timeout means "the process group's default" to gloo.
                left = max(start + self.timeout_s - time.monotonic(), 1e-3)
                if not req.wait(datetime.timedelta(seconds=left)):
                    raise RuntimeError("wait returned False")
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            waits = [f"receive of {describe(l)} from pipeline rank {p} (global {self.global_ranks[p]})" for p, _, l in recvs]
            waits += [f"send of {describe(l)} to pipeline rank {p} (global {self.global_ranks[p]})" for p, _, l in sends]
            if elapsed >= 0.99 * self.timeout_s:
                what = (f"did not complete within {self.timeout_s:g} s (set MEGATRON_DUALPIPE_P2P_TIMEOUT or "
                        f"--dualpipe-p2p-timeout to wait longer)")
            else:
                what = (f"failed after {elapsed:.1f} s, before the {self.timeout_s:g} s timeout: a peer probably "
                        f"exited or crashed, look at its log")
            raise P2PTimeoutError(
                f"pipeline rank {self.rank} (global {dist.get_rank()}) {where}: point-to-point batch {what}; "
                f"it waited for: " + "; ".join(waits) + f". Underlying error: {e}") from e

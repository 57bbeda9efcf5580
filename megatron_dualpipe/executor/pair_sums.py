"""The bd sum: both copies of a DualPipe stage := their sum, one all-reduce over the bd pair.

One implementation, used by training (``mcore.grad_reduction.GradReduction`` during the
schedule, ``mcore.finalize.allreduce_bd_grads`` outside it) and by the benchmark
(``bench.bd_sum``), so that the benchmark's figures come from the code path training runs:

* :func:`issue_sum` starts the sums of one chunk's tensors asynchronously: in place for
  contiguous buffers (Megatron DDP's grad buffers, the benchmark's synthetic gradients), else
  flattened per dtype and copied back when waited;
* :class:`PairSums` issues a rank's sums at the points the iteration plan gives
  (``schedule.lowering.reductions``) and waits for none before the end of the schedule (the
  program's ``summed`` ops, :meth:`PairSums.wait`; :meth:`PairSums.finish`), which the plan proves safe: on an accelerator a ``wait()`` would make the
  compute stream wait, and with it every P2P batch posted after it, for the partner's matching
  sum; where the partners finish their chunks at different points the partner first needs one
  of those stalled tensors (issue 17: pp=2 with an odd number of micro-batches hung). It never
  asks whether a sum has completed: what runs after a sum (the data-parallel reductions) starts
  at a place of the plan, the same on every rank, not when a poll happens to see it done.

Torch only (no Megatron); standard ``torch.distributed`` collectives.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import abort, watchdog
from .streams import waits_order_stream

__all__ = ["PendingSum", "issue_sum", "PairSums", "BdSumTimeoutError"]


class BdSumTimeoutError(RuntimeError):
    """A bd sum did not complete within its deadline (the partner did not issue it)."""


class PendingSum:
    """The asynchronous sums of one chunk's tensors (one all-reduce per contiguous buffer or per
    dtype), completed by :meth:`wait`."""

    def __init__(self, chunk: int, works: list, copy_backs: list, what: str, on_host: bool):
        self.chunk, self.works, self._copy_backs, self.what, self.on_host = chunk, works, copy_backs, what, on_host
        self.issued = time.monotonic()
        self.waited = False

    def wait(self, timeout_s: Optional[float] = None, describe: str = "") -> None:
        """Complete the sums: the host waits (gloo) or the current stream does (accelerator: then
        a completed sum costs nothing). Host waits poll the deadline and the shared abort signal."""
        if self.waited:
            return
        for w in self.works:
            abort.wait_work(w, timeout_s, describe or self.what, BdSumTimeoutError, on_host=self.on_host)
        with torch.no_grad():
            for copy_back in self._copy_backs:
                copy_back()
        self.waited = True


def issue_sum(chunk: int, tensors: Sequence[torch.Tensor], group, *, in_place: bool, what: str = "") -> PendingSum:
    """Start all-reduce(SUM) of ``tensors`` over ``group``: one per tensor with ``in_place`` (each
    must be contiguous), else one per dtype over a flattened copy written back by ``wait``."""
    works, copy_backs = [], []
    if in_place:
        works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    else:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        by_dtype: "OrderedDict[torch.dtype, List[torch.Tensor]]" = OrderedDict()
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group_tensors in by_dtype.values():
            flat = _flatten_dense_tensors(group_tensors)
            works.append(dist.all_reduce(flat, group=group, async_op=True))

            def copy_back(flat=flat, group_tensors=group_tensors):
                for t, summed in zip(group_tensors, _unflatten_dense_tensors(flat, group_tensors)):
                    t.copy_(summed)
            copy_backs.append(copy_back)
    on_host = not (tensors and waits_order_stream(tensors[0]))
    return PendingSum(chunk, works, copy_backs, what, on_host)


def sum_now(tensors: Sequence[torch.Tensor], group, *, in_place: bool, what: str = "",
            timeout_s: Optional[float] = None) -> None:
    """:func:`issue_sum` and wait (outside the schedule)."""
    issue_sum(-1, tensors, group, in_place=in_place, what=what).wait(timeout_s)


#: The key of an action in the plan's issue points: (op, dir, mb, stage).
ActionKey = Tuple[str, int, int, int]


def action_key(a) -> ActionKey:
    return (a.op, a.dir, a.mb, a.stage)


class PairSums:
    """One rank's bd sums of one iteration.

    ``issue_points``: {action key: chunks whose sums are issued right after that action, in
    order} from the iteration plan (both partners issue the pair's sums in the same order of
    stages there). ``tensors_of(chunk)`` lists what is summed; :meth:`finish` waits for all.
    """

    def __init__(self, issue_points: Dict[Hashable, List[int]], tensors_of: Callable[[int], Sequence[torch.Tensor]],
                 group, *, in_place: Callable[[int], bool],
                 describe: Callable[[int], str] = lambda c: f"bd sum of chunk {c}", timeout_s: Optional[float] = None):
        self.issue_points = issue_points
        self.tensors_of, self.group, self.in_place = tensors_of, group, in_place
        self.describe, self.timeout_s = describe, timeout_s
        self.pending: List[PendingSum] = []
        self.issued: List[int] = []

    def after_action(self, a) -> None:
        for c in self.issue_points.get(action_key(a), ()):
            self.issue(c)

    def issue(self, c: int) -> None:
        if c in self.issued:
            return
        self.issued.append(c)
        pending = issue_sum(c, list(self.tensors_of(c)), self.group, in_place=self.in_place(c), what=self.describe(c))
        self.pending.append(pending)
        dog = watchdog.current()
        if dog is not None and not pending.on_host:  # watched from its issue: the partner may never join
            for w in pending.works:
                dog.track(w, pending.what, self.timeout_s)

    def wait(self, c: int) -> None:
        """Complete chunk ``c``'s sum (a ``summed`` op of the program); it must have been issued."""
        k = next((k for k, p in enumerate(self.pending) if p.chunk == c), None)
        if k is None:
            raise RuntimeError(f"{self.describe(c)}: waited but {'already waited' if c in self.issued else 'never issued'}")
        self.pending.pop(k).wait(self.timeout_s)

    def finish(self, chunks: Sequence[int]) -> None:
        """End of the schedule: issue what the plan left (none in a planned run), wait for all."""
        for c in chunks:
            self.issue(c)
        while self.pending:
            self.pending.pop(0).wait(self.timeout_s)

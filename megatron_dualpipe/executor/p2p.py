"""Point-to-point communication that waits only for what the next action needs.

The runner posts each planned batch (:meth:`P2P.post`, one ``batch_isend_irecv``) without waiting. A receive
is waited right before the action that consumes it (:meth:`P2P.receive`); a send never on the compute path:
:meth:`P2P.reap` releases completed sends, :meth:`P2P.finish` waits for the rest at the end of the iteration.

On the host (gloo) ``work.wait(timeout)`` blocks and is the deadline; a gloo send's ``is_completed()`` stays
False until someone waits, so one thread per peer waits on its sends in order. On an accelerator (NCCL)
``wait()`` only makes the stream wait, so the iteration's watchdog (:mod:`.watchdog`) polls ``is_completed()``,
marks sends done and enforces the deadlines, aborting the communicators so that a host blocked on the stream
gets an error. One communicator runs its operations in posting order on one stream, so :func:`channel_groups`
may give each channel its own group. A send must complete within ``timeout_s`` of being posted, a receive
within ``timeout_s`` of its consumer starting to wait; every error names this rank, the peer, tensor and action.
"""
from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..schedule.comm import describe as describe_label
from . import abort
from .streams import waits_order_stream
from .watchdog import Watchdog, current as current_watchdog

DEFAULT_TIMEOUT_S = float(os.environ.get("MEGATRON_DUALPIPE_P2P_TIMEOUT", "600"))

#: (peer pipeline rank, tensor, label) of a receive; a send adds a callback run once it completed.
Recv = Tuple[int, torch.Tensor, object]
Send = Tuple[int, torch.Tensor, object, Optional[Callable[[], None]]]


class P2PTimeoutError(RuntimeError):
    """A send or receive did not complete in time, or failed because a peer went away."""


@dataclass(eq=False)
class _Op:
    """One posted send or receive."""

    send: bool
    peer: int
    label: object
    tensor: torch.Tensor
    work: object
    posted: float
    where: str                             # the action before which it was posted
    on_done: Optional[Callable[[], None]] = None
    deadline: Optional[float] = None       # set once something depends on it
    needed_by: Optional[str] = None        # the action that waits for a receive
    done: bool = False                     # set by a waiter thread or the watchdog
    done_event: Optional[threading.Event] = None
    error: Optional[BaseException] = None  # from a waiter thread


class P2P:
    """Sends and receives between the ranks of one pipeline group (peers are pipeline ranks), for one iteration.

    ``host_waits``: the waiting discipline (None: from the device of the first tensor posted).
    ``peak_in_flight``: the most receives and unfinished sends held at once.
    """

    def __init__(self, group, global_ranks: Sequence[int], my_pp_rank: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 describe: Callable[[object], str] = describe_label, host_waits: Optional[bool] = None,
                 channel_groups: Optional[Mapping[Tuple[int, int], object]] = None):
        self.group = group
        self.global_ranks = list(global_ranks)
        self.rank = my_pp_rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.describe = describe
        self.host_waits = host_waits
        self.channel_groups = channel_groups
        self.peak_in_flight = 0
        self._recvs: Dict[object, _Op] = {}
        self._sends: List[_Op] = []
        self._waiters: Dict[int, "queue.SimpleQueue[Optional[_Op]]"] = {}  # host: one thread per peer
        self._watchdog: Optional[Watchdog] = None  # accelerator: the iteration's, or its own
        self._own_watchdog = False

    def first_collective(self, device) -> None:
        """One all-reduce on the pipeline group before its first batched P2P (once per group, every rank): with
        NCCL a group's first collective must involve all its ranks, and DualPipe's first batches do not."""
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

    def post(self, sends: Sequence[Send], recvs: Sequence[Recv], where: str) -> None:
        """Post one planned batch (one ``batch_isend_irecv``, or one operation per channel group); wait for nothing."""
        if not sends and not recvs:
            return
        self._raise_failure()
        if self.host_waits is None:
            self.host_waits = not waits_order_stream(sends[0][1] if sends else recvs[0][1])
        now = time.monotonic()
        try:
            works = self._issue(sends, recvs)
        except RuntimeError as e:
            batch = "; ".join([self._describe(True, p, label) for p, _, label, _ in sends]
                              + [self._describe(False, p, label) for p, _, label in recvs])
            raise P2PTimeoutError(f"pipeline rank {self.rank} (global {dist.get_rank()}) {where}: posting the "
                                  f"point-to-point batch ({batch}) failed: a peer probably exited or crashed, look at "
                                  f"its log. Underlying error: {e}") from e
        for (p, t, label, on_done), w in zip(sends, works):
            op = _Op(True, p, label, t, w, now, where, on_done, deadline=now + self.timeout_s)
            self._sends.append(op)
            self._track_send(op)
        for (p, t, label), w in zip(recvs, works[len(sends):]):
            self._recvs[label] = _Op(False, p, label, t, w, now, where)
        self.peak_in_flight = max(self.peak_in_flight, len(self._sends) + len(self._recvs))

    def _issue(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> list:
        """The works of the sends then the receives, one per operation."""
        g = self.global_ranks
        if self.channel_groups is not None:
            return ([dist.isend(t, g[p], group=self.channel_groups[(self.rank, p)]) for p, t, _, _ in sends]
                    + [dist.irecv(t, g[p], group=self.channel_groups[(p, self.rank)]) for p, t, _ in recvs])
        ops = [dist.P2POp(dist.isend, t, g[p], self.group) for p, t, _, _ in sends]
        ops += [dist.P2POp(dist.irecv, t, g[p], self.group) for p, t, _ in recvs]
        works = dist.batch_isend_irecv(ops)
        return works * len(ops) if len(works) == 1 else works  # a coalescing backend: one work per batch

    def receive(self, label, where: str) -> torch.Tensor:
        """Wait for the receive of ``label`` (on an accelerator: make the stream wait) and return its buffer."""
        self._raise_failure()
        op = self._recvs[label]
        start = time.monotonic()
        op.deadline, op.needed_by = start + self.timeout_s, where
        if self.host_waits:
            try:
                abort.wait_work(op.work, self.timeout_s, f"pipeline rank {self.rank} (global {dist.get_rank()}) "
                                f"{where}: the {self._what(op)}", RuntimeError)
            except RuntimeError as e:
                if isinstance(e, abort.PeerFailedError):
                    raise
                raise self._error(op, where, time.monotonic() - start, e.__cause__ or e) from e
        else:
            self._watch_op(op)
            op.work.wait()
        del self._recvs[label]
        return op.tensor

    def reap(self) -> None:
        """Release the buffers of the completed sends; raise if one failed or is past its deadline."""
        self._raise_failure()
        if not self._sends:
            return
        now = time.monotonic()
        keep = []
        for op in self._sends:
            if op.done:
                self._complete(op)
            elif now > op.deadline:
                raise self._error(op, "while computing", now - op.posted, None)
            else:
                keep.append(op)
        self._sends = keep

    def finish(self, where: str) -> None:
        """End of the iteration: every send completes and its buffer is released; helpers stop."""
        try:
            self._raise_failure()
            if self._recvs:
                left = ", ".join(self.describe(label) for label in self._recvs)
                raise RuntimeError(f"pipeline rank {self.rank}: receives posted but never consumed: {left}")
            for op in self._sends:
                self._await_send(op, where)
                self._complete(op)
            self._sends = []
            if self._own_watchdog:
                self._watchdog.drain()  # the host waits for the sends the stream waits for
        finally:
            self.close()

    def complete_send(self, label, where: str) -> None:
        """Complete and release the send of ``label`` now, if not yet (Megatron's backward needs the forward's
        output released); its receiver has it by then, so this waits for bookkeeping only."""
        for k, op in enumerate(self._sends):
            if op.label == label:
                self._await_send(op, where)
                self._complete(op)
                del self._sends[k]
                return

    def _await_send(self, op: _Op, where: str) -> None:
        """Host: block until the peer's waiter saw the send complete, within its deadline."""
        while self.host_waits and not op.done:
            now = time.monotonic()
            if now > op.deadline:
                raise self._error(op, where, now - op.posted, None)
            if not op.done_event.wait(min(op.deadline - now, abort.POLL_S)):
                abort.raise_if_failed(f"pipeline rank {self.rank} (global {dist.get_rank()}) {where}: the "
                                      f"{self._what(op)}")

    def close(self) -> None:
        """Stop the waiter threads and its own watchdog: a watchdog never outlives its iteration, so a failed
        iteration's deadlines cannot abort the communicators later."""
        if self._own_watchdog:
            self._watchdog.stop()
        for q in self._waiters.values():
            q.put(None)
        self._waiters = {}

    def _track_send(self, op: _Op) -> None:
        if not self.host_waits:
            self._watch_op(op)
            return
        if op.peer not in self._waiters:
            q: "queue.SimpleQueue[Optional[_Op]]" = queue.SimpleQueue()
            threading.Thread(target=_wait_sends, args=(q,), daemon=True, name=f"p2p-sends-to-{op.peer}").start()
            self._waiters[op.peer] = q
        op.done_event = threading.Event()
        self._waiters[op.peer].put(op)

    def _complete(self, op: _Op) -> None:
        if op.error is not None:
            raise self._error(op, "after sending", time.monotonic() - op.posted, op.error)
        if not self.host_waits:
            op.work.wait()  # the stream waits for the send before the buffer can be reused
        if op.on_done is not None:
            op.on_done()

    def _watch_op(self, op: _Op) -> None:
        """Hand ``op`` to the watchdog: it marks it done, or raises its deadline naming it."""
        if self._watchdog is None:
            self._watchdog = current_watchdog()
            if self._watchdog is None:
                self._watchdog, self._own_watchdog = Watchdog(self.timeout_s), True
        what = (f"pipeline rank {self.rank} (global {dist.get_rank()}) {op.needed_by or 'after posting'}: the "
                f"{self._what(op)} (posted {op.where})")
        self._watchdog.track(op.work, what, self.timeout_s, on_done=lambda: setattr(op, "done", True),
                             on_timeout=lambda waited: self._error(op, op.needed_by or op.where, waited, None))

    def _raise_failure(self) -> None:
        if self._watchdog is not None:
            self._watchdog.check()

    def _describe(self, send: bool, peer: int, label) -> str:
        where = f"pipeline rank {peer} (global {self.global_ranks[peer]})"
        return f"{'send' if send else 'receive'} of {self.describe(label)} {'to' if send else 'from'} {where}"

    def _what(self, op: _Op) -> str:
        return self._describe(op.send, op.peer, op.label)

    def _error(self, op: _Op, where: str, elapsed: float, cause: Optional[BaseException]) -> P2PTimeoutError:
        if cause is None or elapsed >= 0.99 * self.timeout_s:
            what = (f"did not complete within {self.timeout_s:g} s (set MEGATRON_DUALPIPE_P2P_TIMEOUT or "
                    f"--dualpipe-p2p-timeout to wait longer)")
        else:
            what = (f"failed after {elapsed:.1f} s, before the {self.timeout_s:g} s timeout: a peer probably "
                    f"exited or crashed, look at its log")
        others = [o for o in self._sends + list(self._recvs.values())
                  if o is not op and (not o.done or o.error is not None)]
        pending = "; ".join(f"{self._what(o)} (posted {o.where})" for o in others)
        return P2PTimeoutError(
            f"pipeline rank {self.rank} (global {dist.get_rank()}) {where}: the {self._what(op)} (posted {op.where}) "
            f"{what}" + (f"; still unfinished: {pending}" if pending else "")
            + (f". Underlying error: {cause}" if cause is not None else ""))


def channels_of(plans) -> List[Tuple[int, int]]:
    """The channels (sending, receiving pipeline rank) a program's plans use, sorted."""
    return sorted({(r, t.peer) for r, p in enumerate(plans) for b in p.batches for t in b.sends})


def channel_groups(global_ranks: Sequence[int], channels: Iterable[Tuple[int, int]]) -> Dict[Tuple[int, int], object]:
    """One two-rank process group per channel (sending, receiving pipeline rank), for ``P2P(channel_groups=...)``.

    NCCL runs one communicator's operations in posting order on one stream, so on the pipeline group a receive
    completes only after every send posted before it; a channel's own group waits only for that channel.
    Collective (``new_group``): every rank calls it with the same arguments, in the same order.
    """
    return {(s, d): dist.new_group([global_ranks[s], global_ranks[d]]) for s, d in sorted(channels)}


def _wait_sends(q) -> None:
    """A host waiter thread: wait for each send to one peer in posting order (a gloo send's ``is_completed()``
    stays False until someone waits)."""
    while True:
        op = q.get()
        if op is None:
            return
        try:
            op.work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the runner's thread
            op.error = e
        op.done = True
        op.done_event.set()

"""Deadlines and the abort signal for the waits the host does not see: stream waits on an accelerator.

There a collective whose peer raised or hangs holds the stream, and the next host sync, until NCCL's timeout,
whose error names no peer. Every stream wait of an iteration is handed to its :class:`Watchdog` with what it is
and a deadline; one thread polls ``is_completed()`` and the abort flag. A deadline counts from when the device
reaches the wait (:func:`device_marker`), not when the host issued it: the host runs ahead, and a healthy
iteration with a short ``--dualpipe-p2p-timeout`` was aborted everywhere (issue 35, finding 5). On a missed
deadline or a peer's failure it keeps a named error, tells every rank and aborts the communicators, so that a
host blocked on the stream gets an error; :func:`watching` raises the named error. It never acts on a later
iteration's communicators.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch.distributed as dist

from . import abort

log = logging.getLogger("megatron_dualpipe")

#: How often the watchdog thread looks at the outstanding works and the abort flag.
POLL_S = 0.005
#: A stream wait's deadline when its caller gives none.
DEFAULT_TIMEOUT_S = 600.0


class StreamWaitTimeoutError(RuntimeError):
    """A wait on an accelerator did not complete within its deadline."""


@dataclass(eq=False)
class Tracked:
    """One outstanding work: ``what`` names this rank, the peer and the collective."""

    work: object
    what: str
    deadline: Optional[float]  # None until the device reached the wait (``reached``)
    timeout_s: float
    on_done: Optional[Callable[[], None]] = None
    #: builds the error of a missed deadline from the seconds waited (default: StreamWaitTimeoutError)
    on_timeout: Optional[Callable[[float], BaseException]] = None
    #: completes when the device reaches the wait (an event recorded where it was issued); None: now
    reached: object = None
    done: bool = False
    issued: float = field(default_factory=time.monotonic)

    def started(self, now: float) -> bool:
        """Whether the deadline runs (it starts when the device has reached the wait)."""
        if self.deadline is None and (self.reached is None or self.reached.query()):
            self.deadline = now + self.timeout_s
        return self.deadline is not None


def device_marker():
    """An event recorded on the current stream where a stream wait is issued, or None without an accelerator."""
    import torch

    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def abort_communicators() -> None:
    """Abort every communicator of this process so that a host blocked on a stream sees an error (best
    effort): each group's ``ProcessGroup.abort()``, NCCL's inside one group start/end as torch's own abort of
    the world does (aborted one by one they can deadlock: pytorch#119797). torch's group registry is left alone
    (the main thread may read it); ``abort()`` is idempotent."""
    from torch.distributed import distributed_c10d as c10d

    try:
        groups = sorted(c10d._world.pg_names, key=lambda g: c10d._world.pg_names[g], reverse=True)
        nccl = _nccl_backend(groups)
        if nccl is not None:
            nccl._group_start()
        try:
            for group in groups:
                group.abort()
        finally:
            if nccl is not None:
                nccl._group_end()
    except Exception as e:  # noqa: BLE001 - the error is already logged and will be raised
        log.error("megatron-dualpipe: could not abort the communicators: %s", e)


def _nccl_backend(groups):
    """The NCCL backend of the default group, whose group start/end brackets the aborts, or None."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    default = c10d.GroupMember.WORLD
    if default is None or not c10d.is_nccl_available():
        return None
    try:
        backend = default._get_backend(torch.device("cuda"))
    except RuntimeError:
        return None
    return backend if isinstance(backend, c10d.ProcessGroupNCCL) else None


class Watchdog:
    """The outstanding stream waits of one iteration (see the module docstring)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self.failure: Optional[BaseException] = None
        self.aborted = False
        self._tracked: List[Tracked] = []
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def track(self, work, what: str, timeout_s: Optional[float] = None, *, on_done=None, on_timeout=None) -> Tracked:
        """Watch ``work`` from now on, within ``timeout_s`` (default: the watchdog's)."""
        self.check()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        entry = Tracked(work, what, None, timeout_s, on_done, on_timeout, reached=device_marker())
        entry.started(time.monotonic())
        with self._lock:
            known = next((t for t in self._tracked if t.work is work), None)
            if known is not None:  # a bd sum watched from its issue, then waited
                return known
            self._tracked.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="megatron-dualpipe-watchdog")
                self._thread.start()
        _abort_between_iterations()
        return entry

    def check(self) -> None:
        """Raise the error the watchdog found, if any."""
        if self.failure is not None:
            raise self.failure

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drain(self, poll_s: float = 0.001) -> None:
        """Block until every tracked work completed, or raise the watchdog's error."""
        while self.is_alive() and not all(t.work.is_completed() for t in self.outstanding()):
            time.sleep(poll_s)
        self.check()

    def stop(self) -> None:
        """Stop watching at once; returns once the thread has ended, so nothing of this watchdog acts later."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def outstanding(self) -> List[Tracked]:
        with self._lock:
            return [t for t in self._tracked if not t.done]

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            failed = abort.failure()
            if failed is not None:
                whats = "; ".join(f"{t.what} (waited {time.monotonic() - t.issued:.1f} s)" for t in self.outstanding())
                waiting = f"stopped waiting for {whats}" if whats else "stopped (none of its collectives outstanding)"
                self._fail(abort.PeerFailedError(f"global rank {_rank()} {waiting} because {failed}"), tell=False)
                return
            if self._sweep():
                return

    def _sweep(self) -> bool:
        """Mark completed works done, drop them; True once a deadline was missed (and handled)."""
        now = time.monotonic()
        for t in self.outstanding():
            if t.work.is_completed():
                t.done = True
                if t.on_done is not None:
                    t.on_done()
            elif t.started(now) and now > t.deadline:
                waited = now - t.deadline + t.timeout_s
                self._fail(t.on_timeout(waited) if t.on_timeout is not None else StreamWaitTimeoutError(
                    f"{t.what}: did not complete within {t.timeout_s:g} s (set --dualpipe-p2p-timeout or "
                    f"MEGATRON_DUALPIPE_P2P_TIMEOUT to wait longer)"), tell=True)
                return True
        with self._lock:
            self._tracked = [t for t in self._tracked if not t.done]
        return False

    def _fail(self, error: BaseException, tell: bool) -> None:
        self.failure = error
        log.error("megatron-dualpipe: %s", error)
        if tell:
            abort.signal(f"{type(error).__name__}: {error}")
        self.aborted = True
        abort_communicators()


_BETWEEN: list = [None]  # the listener told to abort the communicators between iterations


def _abort_between_iterations() -> None:
    """Once this process waits on a stream: a failure heard between iterations (e.g. in the optimizer step's
    grad-norm all-reduce) aborts the communicators too, instead of waiting for NCCL's timeout."""
    heard = abort.listener()
    if heard is None or _BETWEEN[0] is heard:
        return
    _BETWEEN[0] = heard

    def between(message: str) -> None:
        if abort.WATCHING[0] is None:  # in an iteration its watchdog does it, naming what waited
            log.error("megatron-dualpipe: global rank %d aborts its communicators between iterations because %s",
                      _rank(), message)
            abort_communicators()
    heard.on_heard(between)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def current() -> Optional[Watchdog]:
    """The watchdog of the running iteration, or None outside one."""
    return abort.WATCHING[0]


@contextlib.contextmanager
def watching(timeout_s: float = DEFAULT_TIMEOUT_S):
    """One iteration under a :class:`Watchdog`: an exception caused by its abort becomes its named
    error; at the end the host waits for what is outstanding; the watchdog stops on leaving."""
    abort.raise_if_failed(f"global rank {_rank()} before an iteration")  # a peer failed in an earlier one
    dog, before = Watchdog(timeout_s), abort.WATCHING[0]
    abort.WATCHING[0] = dog
    try:
        yield dog
        dog.drain()
    except BaseException as e:
        dog.stop()
        if dog.failure is not None and dog.failure is not e and not isinstance(e, abort.PeerFailedError):
            raise dog.failure from e  # the error its abort caused: the named one instead
        raise
    finally:
        dog.stop()
        abort.WATCHING[0] = before

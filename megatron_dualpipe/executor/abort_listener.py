"""Hear another rank's failure without polling the store: one thread per process blocks on it.

Every rank polling ten times a second is ~40,000 requests per second at 4,096 ranks on the rendezvous store
NCCL also uses. A ``TCPStore.wait``, on a connection of its own (``clone``: a blocked wait holds the client's
lock), costs one WAIT and one CANCEL per :data:`REARM_S`. Other stores, and a TCPStore rank 0 hosts, are polled
with an exponential backoff. The waits read :attr:`Listener.message`, a local attribute.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
from typing import Optional

log = logging.getLogger("megatron_dualpipe")

#: How long one blocking wait lasts before it is re-armed (requests per rank: 2 / REARM_S).
REARM_S = 600.0
#: First and longest interval between two polls of a store that cannot block (not a TCPStore).
BACKOFF_S = (0.1, 5.0)


def outlives_the_ranks() -> bool:
    """Whether the store is torchrun's agent's, which outlives every rank. Otherwise rank 0 hosts it and goes
    with its exit; a wait blocked on it would then fail in C++ while another rank's Python finalizes, aborting
    it ("terminate called without an active exception"), so such a store is polled."""
    import os

    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def base_store(store):
    """The store under the prefixes: a key written there is the same key for every rank's clone."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


class Listener:
    """Waits for ``key`` on ``store`` (a non-prefix store) in a daemon thread; :attr:`message` is its
    value once set, by another rank or by :meth:`hear` (this rank's own failure)."""

    def __init__(self, store, key: str):
        self.store, self.key = store, key
        self.message: Optional[str] = None
        self.requests = 0  # store requests this listener issued (a connection counts one)
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._on_heard: list = []
        self._stop = threading.Event()
        self._polls = False  # set by the thread: the store cannot block (or is rank 0's)
        self._thread = threading.Thread(target=self._run, daemon=True, name="megatron-dualpipe-abort-listener")
        self._thread.start()
        atexit.register(self._join_at_exit)

    def _join_at_exit(self) -> None:
        """Let the thread end before the interpreter does: a thread returning from the store's C++ call while
        Python finalizes aborts the process. A blocking wait with nothing heard stays on the agent's store,
        which outlives the ranks, harmless."""
        self._stop.set()
        if self.message is not None or self._polls:
            self._thread.join(timeout=5.0)

    def hear(self, message: str) -> str:
        """Take ``message`` as the failure unless one was heard already; return the one kept."""
        with self._lock:
            first = self.message is None
            if first:
                self.message = message
            callbacks = list(self._on_heard) if first else []
        for callback in callbacks:
            callback(self.message)
        return self.message

    def on_heard(self, callback) -> None:
        """Call ``callback(message)`` once a failure is heard (at once if it was)."""
        with self._lock:
            heard = self.message
            if heard is None:
                self._on_heard.append(callback)
        if heard is not None:
            callback(heard)

    def _run(self) -> None:
        try:
            from torch.distributed import TCPStore

            blocking = isinstance(self.store, TCPStore) and outlives_the_ranks()
            self._polls = not blocking
            store = self.store.clone() if blocking else self.store
            self.requests += int(blocking)
            (self._block if blocking else self._poll)(store)
            if self.message is None and self._stop.is_set():
                return  # the interpreter's exit: no more store calls
            self.requests += 1
            self.hear(store.get(self.key).decode(errors="replace"))
        except Exception as e:  # noqa: BLE001 - a store gone away: the waits' own deadlines remain
            log.debug("megatron-dualpipe: the abort listener stopped: %s", e)

    def _block(self, store) -> None:
        while self.message is None:
            start = time.monotonic()
            self.requests += 1
            try:
                store.wait([self.key], datetime.timedelta(seconds=REARM_S))
                return
            except Exception:  # noqa: BLE001 - a timeout re-arms (CANCEL_WAIT); anything sooner is fatal
                self.requests += 1
                if time.monotonic() - start < 0.9 * REARM_S:
                    raise

    def _poll(self, store) -> None:
        interval = BACKOFF_S[0]
        while self.message is None and not self._stop.is_set():
            self.requests += 1
            if store.check([self.key]):
                return
            self._stop.wait(interval)
            interval = min(2 * interval, BACKOFF_S[1])

"""A failing rank stops its peers within seconds: a shared abort signal, and waits that check it.

Without it a rank that raises leaves its peers waiting until their deadline (600 s by default), and their
error then blames a receive. The failing rank writes its error into the rendezvous store (:func:`signal`), one
thread per rank hears it (:mod:`.abort_listener`), and every wait checks that local flag: a host wait
(:func:`wait_work`) every :data:`POLL_S`, a stream wait through the iteration's watchdog. Either raises
:class:`PeerFailedError` naming this rank, what it waited for and the rank that failed. One key per job
attempt: a restarted attempt (torchrun ``--max-restarts``) starts clean.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from typing import Optional, Type

import torch.distributed as dist

from .abort_listener import Listener, base_store

#: One key per job attempt: torchrun's shared rendezvous store outlives a restart, the abort must not.
KEY = f"megatron_dualpipe/abort/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
#: How often a host wait looks at the deadline and the abort signal.
POLL_S = 0.1
#: The running iteration's watchdog (set by ``watchdog.watching``): stream waits are handed to it.
WATCHING: list = [None]


class PeerFailedError(RuntimeError):
    """Another rank raised; this rank stopped waiting for it."""


def _store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - no store, no signal (single process, no default group)
        return None


_LISTENING: list = [None, None]  # [the default group it listens for, its Listener]


def listener() -> Optional[Listener]:
    """This process's listener for the current default group (started on first use), or None."""
    store = _store()
    if store is None:
        return None
    group = dist.distributed_c10d._get_default_group()
    if _LISTENING[0] is not group:
        _LISTENING[:] = [group, Listener(base_store(store), KEY)]
    return _LISTENING[1]


def signal(message: str) -> Optional[str]:
    """Tell every rank that this one failed (best effort: never raises); returns the failure kept, another
    rank's when it signalled first (None without a store)."""
    heard = listener()
    if heard is None:
        return None
    message = f"global rank {dist.get_rank()} failed: {message}"
    try:
        first = heard.store.compare_set(KEY, "", message)  # atomic: the first signal stays
        return heard.hear(first.decode(errors="replace") if isinstance(first, bytes) else str(first))
    except Exception:  # noqa: BLE001 - the original error is what matters
        return heard.hear(message)


@contextlib.contextmanager
def signalling_failure():
    """Signal any exception raised inside (but a :class:`PeerFailedError`), then let it propagate; an error
    that came after another rank had signalled (a connection its exit closed) becomes the
    :class:`PeerFailedError` naming that rank."""
    try:
        yield
    except PeerFailedError:
        raise
    except BaseException as e:
        kept = signal(f"{type(e).__name__}: {str(e)[:2000]}")
        own = f"global rank {dist.get_rank()} failed: " if dist.is_initialized() else None
        if kept is not None and own is not None and not kept.startswith(own):
            raise PeerFailedError(f"global rank {dist.get_rank()} stopped ({type(e).__name__}: {str(e)[:300]}) "
                                  f"because {kept}") from e
        raise


def failure() -> Optional[str]:
    """The message of the first rank that signalled, or None: a local read, no store request."""
    heard = listener()
    return None if heard is None else heard.message


def raise_if_failed(waiting: str) -> None:
    """Raise :class:`PeerFailedError` if a rank signalled; ``waiting`` says who waits for what."""
    msg = failure()
    if msg is not None:
        raise PeerFailedError(f"{waiting}: stopped waiting because {msg}")


def wait_work(work, timeout_s: Optional[float], waiting: str, timeout_error: Type[Exception] = TimeoutError,
              on_host: bool = True) -> None:
    """Wait for a ``torch.distributed`` work within ``timeout_s`` (None: no deadline of ours), checking the
    abort signal. ``on_host=False``: the stream waits, the iteration's watchdog (:data:`WATCHING`) keeps the
    deadline. ``waiting`` names this rank, the peer and what was awaited."""
    if not on_host:
        raise_if_failed(waiting)
        if WATCHING[0] is not None:
            WATCHING[0].track(work, waiting, timeout_s)
        work.wait()
        return
    done, error = threading.Event(), []

    def wait():
        try:
            work.wait() if timeout_s is None else work.wait(datetime.timedelta(seconds=timeout_s))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            error.append(e)
        done.set()

    threading.Thread(target=wait, daemon=True, name="megatron-dualpipe-wait").start()
    start = time.monotonic()
    while not done.wait(POLL_S):
        raise_if_failed(waiting)
        if timeout_s is not None and time.monotonic() - start > timeout_s + 1.0:
            break
    if not done.is_set() or error:
        raise_if_failed(waiting)
        elapsed = time.monotonic() - start
        cause = f": {error[0]}" if error else ""
        raise timeout_error(f"{waiting}: did not complete ({elapsed:.1f} s, timeout {timeout_s} s){cause}") \
            from (error[0] if error else None)

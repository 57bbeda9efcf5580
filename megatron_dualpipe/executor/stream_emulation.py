"""A CPU emulation of NCCL's stream semantics, so that the accelerator branches run in CI.

On a GPU ``Work.wait()`` makes the stream wait, and everything the rank issues later with it; on gloo it
blocks the host, which does the same to the executor (all it issues is stream-ordered). So within
:func:`emulate_nccl` CPU tensors take the accelerator branches, and the works of ``all_reduce``,
``batch_isend_irecv``, ``isend`` and ``irecv`` behave like NCCL's (:class:`EmulatedWork`): ``is_completed()``
turns True by itself, ``wait()`` stands for the stream wait and after ``deadline_s`` raises
:class:`EmulatedStreamDeadlock` (a GPU would hang); ``ProcessGroup.abort()`` ends every emulated wait with
:class:`EmulatedCommunicatorAborted`, as NCCL's abort does, coalesced collectives (Megatron DDP's) included.
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .streams import emulating_stream_waits

_WRAPPED = ("all_reduce", "batch_isend_irecv", "isend", "irecv")
#: What a collective returns inside ``_coalescing_manager`` (Megatron DDP's): the manager's
#: handle is the work, waited where NCCL's would be.
_ILLEGAL_WORK = getattr(c10d, "_IllegalWork", type(None))


class EmulatedStreamDeadlock(RuntimeError):
    """An emulated stream wait did not end: on a GPU this rank's stream would wait forever."""


class EmulatedCommunicatorAborted(RuntimeError):
    """The communicators were aborted while an emulated stream waited (NCCL: the wait errors)."""


#: Set by the emulated ``ProcessGroup.abort``: every emulated stream wait then ends.
_ABORTED = threading.Event()


#: What the emulation saw in this process: works it wrapped, stream waits (``wait()`` calls).
STATS = {"works": 0, "stream_waits": 0}


class EmulatedWork:
    """A gloo work with NCCL's behaviour (see the module docstring)."""

    def __init__(self, works, what: str, deadline_s: float):
        """``works``: one gloo work, or a batch's (completed when all are, as NCCL's one work of a batch)."""
        self._works = works if isinstance(works, list) else [works]
        self.what, self.deadline_s = what, deadline_s
        self.issued = time.monotonic()
        STATS["works"] += 1
        self._done = threading.Event()
        self._error = None
        threading.Thread(target=self._wait, daemon=True, name="emulated-nccl-work").start()

    def _wait(self) -> None:
        try:
            for w in self._works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 - raised by the waiter
            self._error = e
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:
        """The stream wait: nothing this rank issues later runs before the operation completed."""
        STATS["stream_waits"] += 1
        end = time.monotonic() + self.deadline_s
        while not self._done.wait(0.002):
            if _ABORTED.is_set():
                raise EmulatedCommunicatorAborted(f"global rank {dist.get_rank()}: the communicators were aborted "
                                                  f"while the emulated stream waited for {self.what}")
            if time.monotonic() < end:
                continue
            raise EmulatedStreamDeadlock(
                f"global rank {dist.get_rank()}: the emulated stream waited {self.deadline_s:g} s for {self.what} "
                f"(issued {time.monotonic() - self.issued:.1f} s ago) and it never completed: on a GPU this rank's "
                f"compute stream, and every batch and collective issued after it, would wait forever")
        if self._error is not None:
            raise self._error
        return True

    def __getattr__(self, name):
        return getattr(self._works[0], name)


def _describe(name: str, args, kwargs) -> str:
    group = kwargs.get("group")
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", [])
        parts = [f"{'send to' if op.op in (dist.isend, c10d.isend) else 'receive from'} global rank {op.peer}"
                 for op in ops]
        return "a P2P batch (" + ", ".join(parts) + ")"
    if name in ("isend", "irecv"):
        peer = args[1] if len(args) > 1 else next((kwargs[k] for k in ("dst", "src", "group_dst", "group_src")
                                                   if kwargs.get(k) is not None), "?")
        return f"{'a send to' if name == 'isend' else 'a receive from'} global rank {peer}"
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return f"an all-reduce over global ranks {ranks}"


@contextlib.contextmanager
def emulate_nccl(deadline_s: float = 20.0):
    """Within: CPU tensors take the accelerator branches, and works behave like NCCL's."""
    saved = {}

    def wrap(name, fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            what = _describe(name, args, kwargs)
            if isinstance(result, list):  # a batch: one work that completes with all its operations
                return [EmulatedWork(list(result), what, deadline_s)] if result else result
            if result is None or isinstance(result, (EmulatedWork, _ILLEGAL_WORK)):  # inside a coalescing manager
                return result
            return EmulatedWork(result, what, deadline_s)
        return wrapped

    for name in _WRAPPED:
        fn = getattr(c10d, name)
        new = wrap(name, fn)
        for mod in (dist, c10d):
            if getattr(mod, name, None) is fn:
                saved[(mod, name)] = fn
                setattr(mod, name, new)
    saved[(dist.ProcessGroup, "abort")] = dist.ProcessGroup.abort
    dist.ProcessGroup.abort = lambda group: _ABORTED.set()
    saved[(c10d._CoalescingManager, "wait")] = c10d._CoalescingManager.wait
    c10d._CoalescingManager.wait = _coalesced_stream_wait(deadline_s)
    _ABORTED.clear()
    try:
        with emulating_stream_waits():
            yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def _coalesced_stream_wait(deadline_s: float):
    def wait(cm) -> None:
        for w in cm.works:
            EmulatedWork(w, "a coalesced collective (Megatron DDP's handle)", deadline_s).wait()
    return wait


__all__ = ["EmulatedWork", "EmulatedStreamDeadlock", "EmulatedCommunicatorAborted", "emulate_nccl"]

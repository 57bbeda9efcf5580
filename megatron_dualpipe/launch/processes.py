"""The processes a command starts: in their own session, relayed, stopped with every descendant.
``torchrun`` starts each rank in a session of its own, so the ranks neither get the terminal's Ctrl-C
nor die with ``torchrun``: re-parented to PID 1 they would go on training. Standard library only.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Set

#: Seconds the stopped processes get to exit after SIGTERM before SIGKILL.
GRACE_SECONDS = 5.0
#: The signals that interrupt a command (:mod:`.interrupts`).
INTERRUPTING = ("SIGINT", "SIGTERM", "SIGHUP")


def handle(names: Sequence[str], handler) -> None:
    """``handler`` for the signals ``names`` this platform has; only the main thread may set them."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in names:
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, handler)


# Finding and stopping processes

def _stat(pid) -> Optional[List[bytes]]:
    """The fields after ``(comm)`` of ``/proc/PID/stat`` (state, ppid, ...), or None. comm may hold
    spaces and parentheses: the last ")" ends it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def _parents() -> Dict[int, int]:
    """pid -> parent pid of every process visible in /proc (empty where there is no /proc)."""
    try:
        names = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return {}
    fields = {int(name): _stat(name) for name in names}
    return {pid: int(f[1]) for pid, f in fields.items() if f and len(f) > 1}


def descendants(pid: int) -> Set[int]:
    """Every process below ``pid`` (children, their children, ...), now."""
    children: Dict[int, List[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found: Set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal_all(pgid: int, pids: Set[int], sig: int) -> None:
    for kill, target in ([(os.killpg, pgid)] if pgid > 0 else []) + [(os.kill, pid) for pid in pids]:
        with contextlib.suppress(OSError):
            kill(target, sig)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat(pid)  # a zombie has exited: it only waits for its parent to reap it
    return fields is None or fields[:1] != [b"Z"]


def stop_descendants(grace: float = GRACE_SECONDS) -> None:
    """Stop every process below this one (SIGTERM, SIGKILL after ``grace``): those :func:`run` did not start."""
    family = descendants(os.getpid())
    if not family:
        return
    _signal_all(-1, family, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_all(-1, family | descendants(os.getpid()), signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:  # reap our own children
            pass


def stop(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """Stop ``proc``, its process group and every descendant, even in sessions of their own; wait for all."""
    family = descendants(proc.pid)
    _signal_all(proc.pid, family | {proc.pid}, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(p) for p in family):
            return
        family |= descendants(proc.pid) if proc.returncode is None else set()
        time.sleep(0.05)
    family |= descendants(proc.pid)
    _signal_all(proc.pid, family | {proc.pid}, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.05)


# Running a command

def _relay(source, sink, reader_gone: threading.Event, stopped: threading.Event) -> None:
    """Copies a child's output to ours until ``stopped``; notes when our reader has gone."""
    fd = source.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        if stopped.is_set():
            continue  # drain, so that the child never blocks on a full pipe
        try:
            sink.write(chunk)
            sink.flush()
        except BrokenPipeError:
            reader_gone.set()
        except (OSError, ValueError):
            pass


def _reader_closed(stream) -> bool:
    """Whether ``stream`` is a pipe whose reader has gone (``| head`` has read its lines): a
    pipe's write end then polls as an error, before anything is written to it."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode) or not hasattr(select, "poll"):
            return False
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR / POLLHUP are always reported
        return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def run(cmd: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
        stdout=None, stderr=None, timeout_s: Optional[float] = None) -> int:
    """Run ``cmd`` in its own session, its output relayed to ``stdout``/``stderr`` (binary; default
    ours); its exit status. On an interruption or a closed stdout every process it started is stopped
    (:func:`stop`) before :class:`KeyboardInterrupt` / :class:`BrokenPipeError` is raised; past
    ``timeout_s``, :class:`subprocess.TimeoutExpired` (``subprocess.run`` would leave torchrun's ranks)."""
    child_env = {"PYTHONUNBUFFERED": "1", **(os.environ if env is None else env)}  # lines come as they are written
    out_sink, err_sink = (getattr(s, "buffer", s) for s in (sys.stdout if stdout is None else stdout,
                                                            sys.stderr if stderr is None else stderr))
    reader_gone, stopped = threading.Event(), threading.Event()
    proc = subprocess.Popen(list(cmd), env=child_env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    relays = [threading.Thread(target=_relay, args=(proc.stdout, out_sink, reader_gone, stopped), daemon=True),
              threading.Thread(target=_relay, args=(proc.stderr, err_sink, threading.Event(), stopped), daemon=True)]
    for r in relays:
        r.start()
    end = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while proc.poll() is None and not reader_gone.is_set() and (end is None or time.monotonic() < end):
            reader_gone.wait(0.1)
            if _reader_closed(out_sink):
                reader_gone.set()
        if reader_gone.is_set():
            raise BrokenPipeError("the reader of stdout went away")
    except BaseException:
        handle(INTERRUPTING, signal.SIG_IGN)  # while stopping, a second Ctrl-C must not start a traceback
        stopped.set()
        stop(proc)
        raise
    timed_out = proc.poll() is None
    if timed_out:
        stop(proc)  # what the processes said until then is relayed
    for r in relays:
        r.join(timeout=5)  # a descendant that outlived the command may hold the pipe open
    proc.stdout.close()
    proc.stderr.close()
    if timed_out:
        raise subprocess.TimeoutExpired(list(cmd), timeout_s)
    return proc.returncode

"""The one way a job's ranks start on this machine and are watched until they end, as torchrun's agent
watches them: the first failure named; past the deadline each rank's stacks (what CI shows of a
hang), then SIGKILL; nothing left running. :func:`run` starts them from the forkserver, :func:`fork`
from this process (the tests' preloaded stand-in).
"""
from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from multiprocessing import forkserver
from typing import Any, Callable, Dict, List, Optional, Sequence

from .ports import free_port

#: After the first failure (torchrun's agent): SIGTERM to the other ranks, SIGKILL this much later.
GRACE_S = 30.0
#: Past the deadline: SIGABRT (each rank writes its stacks), SIGKILL this much later.
STACKS_S = 5.0
#: :func:`run`: how long the other ranks may still report (errors, stacks) after the first failure.
REPORT_GRACE_S = 5.0
#: Imported first by the forkserver: it, and the ranks it forks, leave the terminal's process group.
OWN_SESSION = "megatron_dualpipe.launch.own_session"
#: :func:`run`: how long a rank that sent its result may take to end (``finish``: tearing down).
ENDING_S = 10.0
POLL_S = 0.05


def rank_environment(rank: int, world: int, port: int) -> Dict[str, str]:
    """The rendezvous variables (``env://``) of rank ``rank`` of ``world``, all on this machine."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def stacks_path(prefix: str, rank: int) -> str:
    """Where rank ``rank`` writes its stacks: a file of its own, so dumps cannot interleave."""
    return f"{prefix}.stacks{rank}"


#: The open file faulthandler writes into (kept open for the life of the rank).
_STACKS: List[Any] = []


def stacks_to(path: str) -> None:
    """Every thread's stack on a fatal signal, into ``path``, after a line naming the main thread as
    faulthandler names threads (the failure summary shows that thread's innermost frames)."""
    stacks = open(path, "w")
    stacks.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
    stacks.flush()
    faulthandler.enable(file=stacks, all_threads=True)
    _STACKS.append(stacks)


def labelled_stacks(prefix: str, world: int) -> str:
    """The ranks' dumps, each line marked ``[rank R]`` as the selftest's watchdog marks them; removed."""
    lines = []
    for rank in range(world):
        path = stacks_path(prefix, rank)
        try:
            with open(path, errors="replace") as f:
                dump = [line.rstrip() for line in f if line.strip()]
            os.remove(path)
        except OSError:
            continue
        if len(dump) > 1:  # more than the line naming the main thread
            lines += [f"[rank {rank}] {line}" for line in dump]
    return "".join(f"{line}\n" for line in lines)


class _Forked:
    """A rank forked from this process, with a ``multiprocessing.Process``'s ``pid`` and ``exitcode``."""

    def __init__(self, pid: int):
        self.pid, self._code = pid, None

    @property
    def exitcode(self) -> Optional[int]:
        if self._code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._code = os.waitstatus_to_exitcode(status)
        return self._code


class Ranks:
    """A job's processes, by rank, and how they are stopped; ``stacks_prefix``: their stack files."""

    def __init__(self, procs: Sequence[Any], stacks_prefix: str):
        self.procs, self.stacks_prefix = list(procs), stacks_prefix
        self.ended: List[int] = []  # ranks in the order their ends were seen

    def poll(self) -> List[int]:
        """The ranks still running (not those never started); notes the ends seen since the last call."""
        running = [r for r, proc in enumerate(self.procs) if proc.exitcode is None and proc.pid is not None]
        self.ended += [r for r, proc in enumerate(self.procs) if proc.exitcode is not None and r not in self.ended]
        return running

    def failed(self) -> List[int]:
        return [r for r in self.ended if self.procs[r].exitcode != 0]

    def describe(self, ranks: Sequence[int]) -> str:
        """'rank R exited with code C, rank S was killed by signal N'."""
        codes = [(r, self.procs[r].exitcode) for r in ranks]
        return ", ".join(f"rank {r} " + (f"was killed by signal {-c}" if c < 0 else f"exited with code {c}")
                         for r, c in codes)

    def send(self, sig: int) -> None:
        for rank in self.poll():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[rank].pid, sig)

    def stop(self, grace: float, first: Optional[int] = signal.SIGTERM) -> None:
        """``first`` (None: nothing) to the running ranks, SIGKILL after ``grace``; wait until all ended."""
        if first is not None:
            self.send(first)
        end = time.monotonic() + grace
        while self.poll() and time.monotonic() < end:
            time.sleep(POLL_S)
        self.send(signal.SIGKILL)
        while self.poll():
            time.sleep(POLL_S)


def wait(ranks: Ranks, timeout_s: float, on_failure: Callable[[int, int], None]) -> Optional[int]:
    """Wait for every rank as torchrun's agent does: 0 when all succeeded; 1 once one failed (told to
    ``on_failure(rank, code)``; the others stopped); None past ``timeout_s`` (each rank wrote its stacks)."""
    deadline, failed_at = time.monotonic() + timeout_s, None
    while ranks.poll():
        now = time.monotonic()
        if now > deadline:
            ranks.stop(STACKS_S, signal.SIGABRT)
            return None
        if failed_at is None and ranks.failed():
            failed_at, first = now, ranks.failed()[0]
            ranks.send(signal.SIGTERM)
            on_failure(first, ranks.procs[first].exitcode)
        elif failed_at is not None and now > failed_at + GRACE_S:
            ranks.send(signal.SIGKILL)
        time.sleep(POLL_S)
    return 1 if ranks.failed() else 0


def fork(world: int, child: Callable[[int], None], stacks_prefix: str) -> Ranks:
    """``world`` ranks forked from this process (a Ctrl-C reaches them), each running ``child(rank)``."""
    procs = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            stacks_to(stacks_path(stacks_prefix, rank))
            child(rank)
            os._exit(0)
        procs.append(_Forked(pid))
    return Ranks(procs, stacks_prefix)


def _rank(rank, world, port, fn, args, results, prefix, finish) -> None:
    """One rank of :func:`run`: its result (or its traceback) goes to the parent, then ``finish()``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the ranks
    os.environ.update(rank_environment(rank, world, port))
    stacks_to(stacks_path(prefix, rank))
    status = 0
    try:
        results.put((rank, "ok", fn(rank, world, port, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, "error", f"rank {rank}:\n{traceback.format_exc()}"))
        status = 1
    if finish is not None:
        finish()
    raise SystemExit(status)


def _context(start_method: Optional[str], preload: Sequence[str], exact: bool = False):
    """multiprocessing's context: the forkserver where there is one, made to import ``preload`` (with
    ``exact``, nothing more: a rank that must import its libraries itself, in its own order)."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        _preloading(ctx, [OWN_SESSION, *preload], exact)
    elif start_method == "fork":
        for name in preload:
            importlib.import_module(name)
    return ctx


def _preloading(ctx, modules: Sequence[str], exact: bool) -> None:
    """Make the process-wide forkserver preload at least ``modules`` (``exact``: only them): a running
    one keeps its list, so one started with less (or more) is stopped (CPython's private
    ``ForkServer._stop``; without it the ranks import what they need)."""
    server = forkserver._forkserver
    have = [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]
    if (have == list(modules)) if exact else set(modules) <= set(have):
        return
    if getattr(server, "_forkserver_pid", None) is not None and hasattr(server, "_stop"):
        server._stop()
    ctx.set_forkserver_preload(list(modules) if exact else have + [m for m in modules if m not in have])


def _last_line(report: str) -> str:
    """'rank R: <the exception's line>' from a rank's 'rank R:\\n<traceback>' report."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    return f"{lines[0]} {lines[-1]}" if len(lines) > 1 else (lines[0] if lines else "")


def _failure(errors: List[str], silent: str, stacks: str) -> str:
    """Why :func:`run` failed, its last line naming the cause: a rank that died without a report before
    a neighbour's error, often its echo (gloo's "connection closed by peer"); else the first error."""
    if not silent:
        return f"{stacks}a rank failed: {errors[0]}"
    echo = f"; after it, {_last_line(errors[0])}" if errors else ""
    return (f"{errors[0] if errors else ''}\n{stacks}ranks ended without a result: {silent} (their own output, "
            f"above, says why){echo}")


def _collect(results, ranks: Ranks, timeout_s: float) -> List[Any]:
    """Every rank's result, in rank order; raises once a rank failed (after :data:`REPORT_GRACE_S`) or on timeout."""
    world, got, errors, failed_at = len(ranks.procs), {}, [], None
    end = time.monotonic() + timeout_s
    while True:
        running = ranks.poll()  # before the queue: a rank's report is sent before it ends
        while not results.empty():
            rank, status, payload = results.get()
            got[rank] = payload if status == "ok" else None
            if status != "ok":
                errors.append(payload)
        if len(got) == world and not errors:
            return [got[r] for r in range(world)]
        silent = [r for r in ranks.ended if r not in got]
        now = time.monotonic()
        if failed_at is None and (errors or silent):
            failed_at = now
        if failed_at is not None and (now > failed_at + REPORT_GRACE_S or not running):
            stacks = labelled_stacks(ranks.stacks_prefix, world)
            raise RuntimeError(_failure(errors, ranks.describe(silent), stacks))
        if now > end:
            waiting = [r for r in range(world) if r not in got]
            ranks.stop(STACKS_S, signal.SIGABRT)
            raise RuntimeError(f"{labelled_stacks(ranks.stacks_prefix, world)}ranks {waiting} gave no result within "
                               f"{timeout_s:.0f} s (where each waited: its stacks, above)")
        time.sleep(POLL_S)


def run(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), *, timeout_s: float,
        preload: Sequence[str] = (), start_method: Optional[str] = None,
        finish: Optional[Callable[[], None]] = None, exact_preload: bool = False) -> List[Any]:
    """``fn(rank, world, port, *args)`` (importable) in ``world`` new processes: what each returned, in
    rank order; ``finish()`` runs in each after. Whatever ends this call (Ctrl-C too) ends every rank.
    ``exact_preload``: the ranks' forkserver imported ``preload`` and nothing else (by default one that
    imported more serves too)."""
    ctx = _context(start_method, preload, exact_preload)
    results = ctx.SimpleQueue()
    folder = tempfile.mkdtemp(prefix="megatron-dualpipe-ranks-")
    prefix, port = os.path.join(folder, "rank"), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, fn, tuple(args), results, prefix, finish))
             for r in range(world)]
    ranks = Ranks(procs, prefix)
    try:
        for proc in procs:
            proc.start()
        got = _collect(results, ranks, timeout_s)
    except BaseException:  # a failure, Ctrl-C, SIGTERM: stop everyone now
        ranks.stop(0.0)
        raise
    else:
        ranks.stop(ENDING_S, first=None)  # they end by themselves once their result is sent
        return got
    finally:
        shutil.rmtree(folder, ignore_errors=True)

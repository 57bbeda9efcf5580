"""Processes for the benchmark: one per pipeline rank, started here or by torchrun.

Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set) this process is one rank and the
world is the pipeline. Otherwise :func:`spawn` starts ``world`` processes on this machine with
a fresh port. The backend follows the device: NCCL when there is a GPU, gloo otherwise.
Workers return their results to rank 0 through ``gather_object``; rank 0 returns them to the
caller.
"""
from __future__ import annotations

import datetime
import os
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

from ..launch.ports import free_port


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def device_for(rank: int):
    import torch

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init(rank: int, world: int, timeout_s: float):
    """Join the process group (env:// rendezvous) and return this rank's device."""
    import torch
    import torch.distributed as dist

    device = device_for(rank)
    backend = "gloo" if device.type == "cpu" else "nccl"
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    return device


#: Seconds a rank gives ``destroy_process_group`` once its work is done and reported.
DESTROY_S = 60.0


def _gathered(fn: Callable[..., Any], args: Sequence[Any], timeout_s: float) -> Optional[Any]:
    """Join the group, run ``fn(rank, world, device, *args)``; rank 0 gets every rank's result.
    Leaves the process group up (:func:`_destroy_within` tears it down)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = init(rank, world, timeout_s)
    mine = fn(rank, world, device, *args)
    gathered: List[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    return gathered if rank == 0 else None


def _destroy_within(seconds: float) -> None:
    """``destroy_process_group``, bounded: after a rank raised on purpose (the selftest's last
    stage) a peer's connection may be half closed, and tearing the group down must not keep a
    finished run from ending. Past ``seconds`` the rank says so and exits."""
    import sys
    import threading

    import torch.distributed as dist

    if not dist.is_initialized():
        return

    def give_up() -> None:
        sys.stderr.write(f"megatron-dualpipe: rank {os.environ.get('RANK', '?')}: destroy_process_group did not "
                         f"return within {seconds:g} s after the run ended; exiting without it\n")
        sys.stderr.flush()
        os._exit(0)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        dist.destroy_process_group()
    finally:
        timer.cancel()


def run_here(fn: Callable[..., Any], args: Sequence[Any], timeout_s: float) -> Optional[Any]:
    """Run ``fn(rank, world, device, *args)`` as the torchrun rank; rank 0 gets every rank's result."""
    try:
        return _gathered(fn, args, timeout_s)
    finally:
        _destroy_within(DESTROY_S)


def _entry(rank: int, world: int, port: int, fn, args, collective_timeout_s: float, queue) -> None:
    import signal

    # Ctrl-C reaches the whole process group: the parent stops the workers (spawn), so a worker
    # ignores it rather than printing a KeyboardInterrupt traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:  # the result (or the error) goes to the parent before the group is torn down
        out = _gathered(fn, args, collective_timeout_s)
        if rank == 0:
            queue.put(("ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        _destroy_within(DESTROY_S)


def _dead(procs) -> Optional[str]:
    """'rank R exited with code C, ...' for the processes that ended in failure, else None."""
    dead = [f"rank {r} " + (f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}")
            for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    return ", ".join(dead) or None


def _last_line(report: str) -> str:
    """'rank R: <the exception's line>' from a worker's 'rank R:\n<traceback>' report."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    return f"{lines[0]} {lines[-1]}" if len(lines) > 1 else (lines[0] if lines else "")


#: How long the other ranks may still report after one died without a result.
REPORT_GRACE_S = 5.0
#: How long an error report waits for a rank's death to show: the error may be its echo.
DEATH_SHOWS_S = 1.0


def _await_result(q, procs, timeout_s: float, poll_s: float = 1.0):
    """Rank 0's (status, payload), or raise as soon as a rank died without reporting (a crash, a
    watchdog, the OOM killer: it cannot put its error on the queue) or when ``timeout_s`` passed.
    A rank that raised reports itself through the queue; its neighbours' errors follow. An error
    that is the echo of a death (gloo's "connection closed by peer" on the dead rank's neighbour,
    often on the queue before the parent sees the death) is reported after the dead rank, which
    the last line names first: that line is what the selftest prints."""
    import queue as queue_mod

    end = time.monotonic() + timeout_s
    while True:
        try:
            got = q.get(timeout=max(0.0, min(poll_s, end - time.monotonic())))
        except queue_mod.Empty:
            got = None
        if got is not None and got[0] == "ok":
            return got
        if got is not None:  # an error: the cause, unless a rank's death shows within a moment
            shows = time.monotonic() + DEATH_SHOWS_S
            while _dead(procs) is None and time.monotonic() < shows:
                time.sleep(0.05)
            if _dead(procs) is None:
                return got
        elif _dead(procs) is not None:
            # A report may still be in the pipe; and the other ranks' watchdogs, which fire within
            # seconds of each other (their stage limits started together), get the time to say
            # where they wait before they are stopped: the stuck rank's stack is the one that matters.
            try:
                got = q.get(timeout=max(REPORT_GRACE_S, 2 * poll_s))
            except queue_mod.Empty:
                pass
            if got is not None and got[0] == "ok":
                return got
        if _dead(procs) is not None:
            payload = None if got is None else got[1]
            echo = "" if payload is None else f"; after it, {_last_line(payload)}"
            raise RuntimeError(f"{'' if payload is None else payload}\nbenchmark workers ended without a "
                               f"result: {_dead(procs)} (their own output, above, says why){echo}")
        if time.monotonic() >= end:
            raise RuntimeError(f"benchmark workers gave no result within {timeout_s:.0f} s; exit codes "
                               f"{[p.exitcode for p in procs]}")


def spawn(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), timeout_s: float = 1800.0,
          collective_timeout_s: Optional[float] = None) -> List[Any]:
    """Run ``fn(rank, world, device, *args)`` in ``world`` new processes; return the per-rank
    results. Raises with the failing rank's traceback, when a rank dies without one, or when
    nothing arrives within ``timeout_s`` (the processes are then terminated: nothing is left
    running). ``collective_timeout_s`` (default ``timeout_s``) is the process group's timeout."""
    import multiprocessing as mp

    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["megatron_dualpipe.launch.own_session", "torch", "torch.distributed"])
    q = ctx.Queue()
    port = free_port()
    collective = timeout_s if collective_timeout_s is None else collective_timeout_s
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, tuple(args), collective, q), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        status, payload = _await_result(q, procs, timeout_s)
        if status != "ok":
            raise RuntimeError(f"benchmark worker failed: {payload}")
        return payload
    except BaseException:  # Ctrl-C, SIGTERM, a failure: stop everyone now, nothing written afterwards
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        raise
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
                p.join()

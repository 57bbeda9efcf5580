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
import socket
import traceback
from typing import Any, Callable, List, Optional, Sequence


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


def run_here(fn: Callable[..., Any], args: Sequence[Any], timeout_s: float) -> Optional[Any]:
    """Run ``fn(rank, world, device, *args)`` as the torchrun rank; rank 0 gets every rank's result."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = init(rank, world, timeout_s)
    try:
        mine = fn(rank, world, device, *args)
        gathered: List[Any] = [None] * world if rank == 0 else []
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
        return gathered if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _entry(rank: int, world: int, port: int, fn, args, timeout_s: float, queue) -> None:
    import signal

    # Ctrl-C reaches the whole process group: the parent stops the workers (spawn), so a worker
    # ignores it rather than printing a KeyboardInterrupt traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        out = run_here(fn, args, timeout_s)
        if rank == 0:
            queue.put(("ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), timeout_s: float = 1800.0) -> List[Any]:
    """Run ``fn(rank, world, device, *args)`` in ``world`` new processes; return the per-rank
    results. Raises with the failing rank's traceback, or when nothing arrives in time (the
    processes are then terminated: nothing is left running)."""
    import multiprocessing as mp
    import queue as queue_mod

    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["megatron_dualpipe.bench.own_session", "torch", "torch.distributed"])
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, tuple(args), timeout_s, q), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        try:
            status, payload = q.get(timeout=timeout_s)
        except queue_mod.Empty:
            raise RuntimeError(f"benchmark workers gave no result within {timeout_s:.0f} s; exit codes "
                               f"{[p.exitcode for p in procs]}") from None
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

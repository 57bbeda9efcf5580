"""Processes for the benchmark and the selftest: one per pipeline rank, started here (:func:`spawn`,
through the package's one spawner, :mod:`..launch.spawn`) or by torchrun (:func:`run_here`; the
ranks' results reach rank 0 through ``gather_object``). NCCL with a GPU, gloo otherwise.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
from typing import Any, Callable, List, Optional, Sequence

from ..launch import spawn as spawner


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init(rank: int, world: int, timeout_s: float):
    """Join the process group (env:// rendezvous) and return this rank's device."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    return device


#: Seconds a rank gives ``destroy_process_group`` once its work is done and reported.
DESTROY_S = 60.0
#: What the ranks' forkserver imports once.
TORCH = ("torch", "torch.distributed")


def _destroy_within(seconds: float = DESTROY_S) -> None:
    """``destroy_process_group``, bounded: after a rank raised on purpose (the selftest's last
    stage) a peer's connection may be half closed, and tearing the group down must not keep a
    finished run from ending. Past ``seconds`` the rank says so and exits."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return

    def give_up() -> None:
        print(f"megatron-dualpipe: rank {os.environ.get('RANK', '?')}: destroy_process_group did not return "
              f"within {seconds:g} s after the run ended; exiting without it", file=sys.stderr, flush=True)
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
    import torch.distributed as dist

    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        mine = fn(rank, world, init(rank, world, timeout_s), *args)
        gathered: Optional[List[Any]] = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        return gathered
    finally:
        _destroy_within()


def _in_group(rank: int, world: int, port: int, fn: Callable[..., Any], args: Sequence[Any],
              collective_timeout_s: float) -> Any:
    """One rank of :func:`spawn` (``launch.spawn`` set its rendezvous variables): ``fn(rank, world, device,
    *args)``, returned once every rank has (none tears the group down while a peer still uses it)."""
    import torch.distributed as dist

    mine = fn(rank, world, init(rank, world, collective_timeout_s), *args)
    dist.barrier()
    return mine


def spawn(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), timeout_s: float = 1800.0,
          collective_timeout_s: Optional[float] = None) -> List[Any]:
    """The per-rank results of ``fn(rank, world, device, *args)`` in ``world`` new processes in one process
    group (:func:`..launch.spawn.run`: it raises naming the failing rank, and leaves nothing running)."""
    collective = timeout_s if collective_timeout_s is None else collective_timeout_s
    return spawner.run(_in_group, world, (fn, tuple(args), collective), timeout_s=timeout_s, preload=TORCH,
                       finish=_destroy_within)

"""Run a function in several processes on one machine and collect what each returns.

Only torch is needed here: executor tests on plain torch modules use :func:`run_workers` as it is;
tests that need megatron-core use :func:`harness.megatron_env.run_workers`, which preloads it.
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from megatron_dualpipe.launch.ports import free_port

#: What the worker processes' forkserver imports once before forking them.
TORCH_PRELOAD = ("torch", "torch.distributed")


def to_numpy(obj: Any) -> Any:
    """Tensors (also inside dicts, lists, tuples) as numpy arrays, for passing between processes."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_numpy(v) for v in obj)
    return obj


def _worker_entry(rank, fn, world_size, port, args, queue, num_threads):
    try:
        torch.set_num_threads(num_threads)
        queue.put((rank, "ok", to_numpy(fn(rank, world_size, port, *args))))
    except BaseException:  # report any failure to the parent, including assertion errors
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    start_method: Optional[str] = None,
    preimport: Sequence[str] = TORCH_PRELOAD,
) -> List[Any]:
    """Run `fn(rank, world_size, port, *args)` in `world_size` spawned processes.

    Returns the per-rank return values, with tensors turned into numpy arrays (`to_numpy`;
    pass tensors *to* workers as numpy arrays too); raises with the worker's
    traceback if any rank fails. `fn` must be importable (a module-level function).

    `start_method` defaults to "forkserver" where available: a clean server process imports
    the modules in `preimport` once and forks every worker from there (megatron-core takes
    ~8 s to import on 2 cores, so its tests preload it; executor tests do not). Forking the test
    process itself is not safe: once it has used gloo (some tests run a 1-rank process group
    in-process), a forked child can crash inside ``initialize_model_parallel`` (seen as a
    segmentation fault under pytest-xdist).
    """
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method is None:
        start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    # One intra-op thread per worker: workers outnumber cores, and a forked child must stay out
    # of OpenMP parallel regions, which can hang after a fork from a parent that used them.
    threads = 1
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        _forkserver_preloading(ctx, preimport)
    elif start_method == "fork":
        for name in preimport:
            importlib.import_module(name)
    port = free_port()
    queue = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_worker_entry, args=(rank, fn, world_size, port, tuple(args), queue, threads))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    errors = []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if queue.empty():
            if time.monotonic() > deadline or (
                all(not p.is_alive() for p in procs) and queue.empty()
            ):
                break
            time.sleep(0.05)
            continue
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}:\n{payload}")
            break
    for p in procs:
        p.join(timeout=5 if not errors else 1)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join()
    if errors:
        raise RuntimeError("worker failed:\n" + "\n".join(errors))
    if len(results) < world_size:
        raise RuntimeError(
            f"workers timed out or died; got results from ranks {sorted(results)}, exit codes "
            f"{[p.exitcode for p in procs]}"
        )
    return [results[r] for r in range(world_size)]


def _forkserver_preloading(ctx, modules: Sequence[str]) -> None:
    """Make the (process-wide) forkserver preload at least `modules`.

    A running forkserver keeps the preload list it was started with, so a server started for
    torch-only workers is stopped and restarted once a test asks for more (megatron-core). Uses
    CPython's private ``ForkServer._stop``; without it the workers import what they need.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    have = [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]
    if set(modules) <= set(have):
        return
    running = getattr(server, "_forkserver_pid", None) is not None
    if running and hasattr(server, "_stop"):
        server._stop()
    ctx.set_forkserver_preload(sorted(set(have) | set(modules)))

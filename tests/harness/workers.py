"""Run a function in several processes on one machine and collect what each returns, through the
package's one spawner (:mod:`megatron_dualpipe.launch.spawn`: a failing rank named, a hang shown as
every rank's stacks, nothing left running).

Only torch is needed here: executor tests on plain torch modules use :func:`run_workers` as it is;
tests that need megatron-core use :func:`harness.megatron_env.run_workers`, which preloads it.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch

from megatron_dualpipe.launch import spawn

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


def _in_numpy(rank: int, world_size: int, port: int, fn: Callable[..., Any], *args: Any) -> Any:
    # One intra-op thread per worker: workers outnumber cores, and a forked child must stay out
    # of OpenMP parallel regions, which can hang after a fork from a parent that used them.
    torch.set_num_threads(1)
    return to_numpy(fn(rank, world_size, port, *args))


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    start_method: Optional[str] = None,
    preimport: Sequence[str] = TORCH_PRELOAD,
    exact_preload: bool = False,
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

    The forkserver serves every call of the process: one that imported more than `preimport` (an
    earlier test's megatron-core) serves too, unless `exact_preload`: a rank that must import the
    libraries itself, after installing stand-ins that megatron-core reads at import, asks for it.
    """
    return spawn.run(_in_numpy, world_size, (fn, *args), timeout_s=timeout, preload=preimport,
                     start_method=start_method, exact_preload=exact_preload)

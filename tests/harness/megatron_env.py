"""Single-machine megatron-core environment for tests: gloo process group, model-parallel groups
and seeds (:mod:`megatron_dualpipe.proof.groups`, as the selftest builds them), and
:func:`run_workers` with megatron-core preloaded in the workers. The tiny GPT, its data, the
references and the checks are the package's proof harness (:mod:`megatron_dualpipe.proof`), which
``megatron-dualpipe selftest`` runs on GPUs.

Typical multi-process test::

    def worker(rank, world_size, port, result_queue):
        init_distributed_cpu(rank, world_size, port, pp=world_size)
        try:
            ...
        finally:
            destroy_distributed()

    run_workers(worker, world_size=2)

`init_distributed_cpu` calls `megatron_dualpipe.cpu.enable()`, which does nothing on a GPU machine.
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dualpipe import cpu as cpu_mode
from megatron_dualpipe.proof.groups import init_model_parallel

from . import workers

#: What the workers of megatron-core tests import before forking (once per forkserver).
MEGATRON_PRELOAD = workers.TORCH_PRELOAD + (
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel",
    "megatron.core.distributed",
)


def run_workers(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 120.0,
                **kwargs: Any) -> List[Any]:
    """:func:`harness.workers.run_workers` with megatron-core preloaded in the worker processes."""
    kwargs.setdefault("preimport", MEGATRON_PRELOAD)
    return workers.run_workers(fn, world_size, args=args, timeout=timeout, **kwargs)


def init_distributed_cpu(
    rank: int,
    world_size: int,
    port: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    vpp: Optional[int] = None,
    seed: int = 1234,
    timeout_minutes: int = 2,
) -> None:
    """Start a gloo process group on 127.0.0.1:port, build megatron-core's parallel groups, seed.

    Seeds Python-side torch RNG with `seed` and the model-parallel RNG tracker with
    `model_parallel_cuda_manual_seed(seed)` (CPU tracker in CPU mode).
    """
    cpu = cpu_mode.enable()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import datetime

    dist.init_process_group(
        backend="gloo" if cpu else "nccl",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )
    if not cpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    init_model_parallel(tp=tp, pp=pp, ep=ep, vpp=vpp, timeout_minutes=timeout_minutes, seed=seed)


def destroy_distributed() -> None:
    """Undo `init_distributed_cpu`."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

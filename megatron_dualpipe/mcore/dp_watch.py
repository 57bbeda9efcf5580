"""The data-parallel reductions a chunk started, handed to the iteration's watchdog.

Megatron DDP's ``finish_grad_sync`` waits for ``start_grad_sync``'s handles with no deadline of ours: on an
accelerator a data-parallel peer that raised would hold it until NCCL's timeout. Watched, the works keep the
iteration's deadline and stop at the abort signal, naming this rank, the chunk and the reduction's ranks.
"""
from __future__ import annotations

import torch.distributed as dist

from ..executor import watchdog
from ..executor.streams import waits_order_stream


def watch_dp_reduction(chunk, what: str) -> None:
    """Track the works of ``chunk``'s started data-parallel reductions (accelerator only: on the host the wait
    is gloo's). ``what`` names this rank and the chunk."""
    dog = watchdog.current()
    if dog is None or not waits_order_stream(next(chunk.parameters())):
        return
    for bucket_group in list(getattr(chunk, "bucket_groups", [])) + list(
            getattr(chunk, "expert_parallel_bucket_groups", [])):
        handle = getattr(bucket_group, "grad_reduce_handle", None)
        if handle is None:
            continue
        group = getattr(bucket_group, "intra_distributed_optimizer_instance_group", None) or \
            getattr(bucket_group, "data_parallel_group", None)
        ranks = dist.get_process_group_ranks(group) if group is not None else "?"
        for work in getattr(handle, "works", [handle]):
            dog.track(work, f"{what}: the data-parallel reduction over global ranks {ranks}")

"""Bring every direction's loss entries to the last pipeline rank, where Megatron reads them.

Megatron's training loop reads the per-micro-batch loss dicts from the last pipeline rank only.
Under DualPipe, direction 1 ends on rank 0; under DualPipeV every micro-batch ends on rank 0.
Their entries are shipped to rank pp-1 as tensors, in global micro-batch order (direction 0,
then direction 1): first a small header of keys, shapes and dtypes (``send_object_list``),
then the tensors in one batched P2P, so they stay on the device they were computed on.
"""
from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

from ..schedule.layout import Layout


def gather_losses_on_last_rank(loss_store, layout: Layout, rank: int, global_ranks, group, device) -> List[Any]:
    """The loss entries of every direction on rank pp-1 (``[]`` elsewhere)."""
    last = layout.pp - 1
    result: List[Any] = []
    for d in layout.directions:
        final = layout.stages(d)[-1]
        if not layout.is_last(d, final):
            continue  # DualPipeV's first chunk: its micro-batches go on up the V
        owner, entries = layout.rank_of(d, final), loss_store[d]
        if owner == last:
            if rank == last:
                result.extend(entries)
        elif rank == owner:
            _send_entries(entries, global_ranks[last], group)
        elif rank == last:
            result.extend(_recv_entries(global_ranks[owner], group, device))
    return result if rank == last else []


def _header(entries) -> list:
    head = []
    for e in entries:
        if isinstance(e, dict) and all(isinstance(v, torch.Tensor) for v in e.values()):
            head.append(("dict", [(k, tuple(v.shape), v.dtype) for k, v in e.items()]))
        elif isinstance(e, torch.Tensor):
            head.append(("tensor", [(None, tuple(e.shape), e.dtype)]))
        else:
            head.append(("object", e))
    return head


def _send_entries(entries, dst: int, group) -> None:
    dist.send_object_list([_header(entries)], dst=dst, group=group)
    tensors = [t.detach().contiguous() for e in entries
               for t in (e.values() if isinstance(e, dict) else [e]) if isinstance(t, torch.Tensor)]
    _batched(dist.isend, tensors, dst, group)


def _recv_entries(src: int, group, device) -> List[Any]:
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    head = box[0]
    bufs = [torch.empty(shape, dtype=dtype, device=device) for kind, spec in head if kind != "object"
            for _, shape, dtype in spec]
    _batched(dist.irecv, bufs, src, group)
    out, it = [], iter(bufs)
    for kind, spec in head:
        if kind == "dict":
            out.append({k: next(it) for k, _, _ in spec})
        elif kind == "tensor":
            out.append(next(it))
        else:
            out.append(spec)
    return out


def _batched(op, tensors, peer: int, group) -> None:
    if tensors:
        for req in dist.batch_isend_irecv([dist.P2POp(op, t, peer, group) for t in tensors]):
            req.wait()

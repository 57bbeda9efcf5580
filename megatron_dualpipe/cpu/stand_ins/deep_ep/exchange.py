"""The communication of the stand-in: gloo collectives on the buffer's group.

Rows travel as bytes: every per-token payload of a call (the hidden state, FP8 scales, top-k
indices and weights, the source index) is packed into one byte row per token, so one
``all_to_all_single`` moves them all, whatever their dtypes (gloo's all-to-all needs no dtype
support beyond uint8 then).
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

#: One part of a packed row: (dtype, values per token).
Part = Tuple[torch.dtype, int]


def pack_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[N, *]`` tensors of any dtypes -> one ``[N, bytes]`` uint8 tensor."""
    as_bytes = [p.reshape(p.size(0), math.prod(p.shape[1:])).contiguous().view(torch.uint8) for p in parts]
    return torch.cat(as_bytes, dim=1) if as_bytes else torch.empty(0, 0, dtype=torch.uint8)


def row_layout(parts: Sequence[torch.Tensor]) -> List[Part]:
    """What :func:`unpack_rows` needs to undo :func:`pack_rows` of ``parts``."""
    return [(p.dtype, math.prod(p.shape[1:])) for p in parts]


def unpack_rows(rows: torch.Tensor, layout: Sequence[Part]) -> List[torch.Tensor]:
    """The inverse of :func:`pack_rows`: ``[N, width]`` tensors of the given dtypes."""
    out, offset = [], 0
    for dtype, width in layout:
        nbytes = width * torch.empty(0, dtype=dtype).element_size()
        out.append(rows[:, offset:offset + nbytes].contiguous().view(dtype))
        offset += nbytes
    return out


def all_to_all_rows(rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                    group) -> torch.Tensor:
    """Rows ``[sum(send_counts), B]`` sent in rank order; the rows received, in source-rank order."""
    received = torch.empty(int(sum(recv_counts)), rows.size(1), dtype=rows.dtype)
    dist.all_to_all_single(received, rows.contiguous(), [int(c) for c in recv_counts],
                           [int(c) for c in send_counts], group=group)
    return received


def all_gather_vector(vector: torch.Tensor, group) -> torch.Tensor:
    """Every rank's int64 vector, stacked in rank order: ``[R, len]``."""
    vector = vector.to(torch.int64).contiguous()
    gathered = [torch.empty_like(vector) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, vector, group=group)
    return torch.stack(gathered)

"""Opt-in drift check: both copies of every DualPipe stage must stay bit-identical.

The bd sum gives both copies the same gradient, so the same step keeps them equal bit for bit; anything that
treats them differently (a per-copy statistic, an FP8 amax history, a missed reduction) makes them drift apart
silently. Every N iterations (``--dualpipe-drift-check-interval N``) the pair exchanges two integers per
parameter; :class:`CopiesDriftedError` names the first that differs. A no-op for DualPipeV (no copies).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..executor import abort
from . import bd_pairs
from .finalize import BD_SUM_TIMEOUT_S, chunk_layout
from .model import BIDIRECTIONAL, unwrap_chunk

__all__ = ["CopiesDriftedError", "check_copies_identical"]


class CopiesDriftedError(RuntimeError):
    """The two copies of a DualPipe stage are no longer bit-identical."""


def _checksum_tensor(chunk: torch.nn.Module, device) -> torch.Tensor:
    """Two int64 per parameter: the sum of its words and their sum weighted by position (two words swapped
    show)."""
    sums = []
    for p in unwrap_chunk(chunk).parameters():
        raw = p.detach().contiguous().reshape(-1).view(torch.uint8)  # its bytes, as whole 32-bit words where they fit
        w = (raw.view(torch.int32) if raw.numel() % 4 == 0 else raw).to(torch.int64)
        weights = torch.arange(1, w.numel() + 1, dtype=torch.int64, device=w.device) % 65521
        sums.append(torch.stack([w.sum(), (w * weights).sum()]))
    return torch.stack(sums).to(device) if sums else torch.zeros(0, 2, dtype=torch.int64, device=device)


def check_copies_identical(model: Sequence[torch.nn.Module], timeout_s: float = BD_SUM_TIMEOUT_S) -> int:
    """Raise :class:`CopiesDriftedError` naming the first parameter whose two copies differ;
    return how many parameters were compared. Collective over the bd pair."""
    if chunk_layout(model) != BIDIRECTIONAL or len(model) != 2:
        return 0
    pos = bd_pairs.position()
    device = next(unwrap_chunk(model[0]).parameters()).device
    compared = 0
    for copy_ in bd_pairs.stage_copies(pos):
        chunk = model[copy_.chunk]
        names = [name for name, _ in unwrap_chunk(chunk).named_parameters()]
        mine = _checksum_tensor(chunk, device)
        if pos.is_middle:
            theirs = _checksum_tensor(model[1 - copy_.chunk], device)
            other = pos.me
        else:
            n = mine.shape[0]
            both = torch.zeros(2 * n, 2, dtype=mine.dtype, device=device)  # the pair's lists, lower rank first
            work = dist.all_gather_into_tensor(both, mine, group=pos.group, async_op=True)
            abort.wait_work(work, timeout_s, f"global rank {pos.me}: the drift check of stage {copy_.stage} with "
                            f"global rank {pos.partner}", TimeoutError, on_host=True)
            theirs = both[n:] if pos.me < pos.partner else both[:n]
            other = pos.partner
        differ = (mine != theirs).any(dim=1).nonzero().flatten().tolist() if mine.numel() else []
        if differ:
            raise CopiesDriftedError(
                f"the two copies of stage {copy_.stage} (global ranks {pos.me} and {other}) differ: first in "
                f"parameter {names[differ[0]]!r} ({len(differ)} of {len(names)} parameters differ). Something "
                f"treats the copies differently (see docs/megatron-options.md for the options refused for that reason)")
        compared += len(names)
    return compared

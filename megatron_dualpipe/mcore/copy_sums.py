"""The ways of summing a DualPipe stage's two copies (:mod:`.copy_sum`), and the one chosen."""
from __future__ import annotations

from typing import Sequence

from . import bd_first, dp_first, shared_shard_wrap
from .copy_sum import CopySum

#: Every way; the first is the default.
WAYS = (bd_first.WAY, shared_shard_wrap.WAY, dp_first.WAY)


def chosen(args) -> CopySum:
    """The way Megatron-LM's arguments choose (the argument check refuses two at once)."""
    return next((way for way in WAYS if way.chosen_by(args)), WAYS[0])


def of(model: Sequence) -> CopySum:
    """The way the chunks were built for (the mark their DDP wrapper left)."""
    return next((way for way in WAYS if way.marks(model)), WAYS[0])

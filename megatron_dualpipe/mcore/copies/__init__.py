"""The ways of summing a DualPipe stage's two copies (:class:`.way.CopySumWay`, one module each),
chosen once: from Megatron-LM's arguments when the chunks are built (:func:`chosen`), from the mark
the way's DDP wrapper left on the chunks after (:func:`of`)."""
from __future__ import annotations

from typing import List, Sequence

from ...schedule import registry
from . import dp_first, shared_shard
from .way import CopySumWay

__all__ = ["WAYS", "CopySumWay", "chosen", "of", "flag_problems"]

#: Every way; the first is the default: the bd pair sums each copy's whole buffers during the schedule
#: (``grad_reduction``; in finalize where no schedule did), then each copy reduces over dp as after 1F1B.
WAYS = (CopySumWay(), shared_shard.WAY, dp_first.WAY)


def chosen(args) -> CopySumWay:
    """The way Megatron-LM's arguments choose (:func:`flag_problems` refuses two at once)."""
    return next((way for way in WAYS if way.chosen_by(args)), WAYS[0])


def of(model: Sequence) -> CopySumWay:
    """The way the chunks were built for (the mark their DDP wrapper left)."""
    return next((way for way in WAYS if way.marks(model)), WAYS[0])


def flag_problems(args, schedule: str) -> List[str]:
    """Why the ways' flags cannot run as given: a way needs a schedule whose stages have two copies,
    and one way at a time."""
    on = [way for way in WAYS if way.chosen_by(args)]
    if on and not registry.spec(schedule).mirrored:
        flag = on[0].way.flag
        return [f"{flag} {on[0].purpose}; --pipeline-schedule {schedule} has none: use --pipeline-schedule "
                f"{' or '.join(registry.names(mirrored=True))} or remove {flag}"]
    if len(on) > 1:
        return [f"{' and '.join(sorted(way.way.flag for way in on))} are two ways to sum the copies: keep one "
                "(the shared shard group also halves the optimizer state)"]
    return []

"""The unit of a schedule: one compute action of one pipeline rank.

A schedule is data: per pipeline rank, the ordered :class:`Action` list that the simulator, the
drawings, the planner and the executor all read, so what is drawn and timed is what runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Sequence, Tuple

#: Forward.
F = "F"
#: Backward for the inputs only; the weight gradient is deferred to a later ``W``.
B = "B"
#: Full backward: input and weight gradients together.
BW = "BW"
#: A deferred weight gradient of an earlier ``B``.
W = "W"
OPS = (F, B, BW, W)


@dataclass(frozen=True)
class Action:
    """One compute action.

    ``dir`` is the direction of the micro-batch's pipeline: 0 for micro-batches that enter at
    pipeline rank 0, 1 for those that enter at rank pp-1 (DualPipe). For DualPipeV, 0 is the
    chunk holding stages 0..pp-1 and 1 the chunk holding stages pp..2pp-1 (the way back up the
    "V"); a micro-batch passes through both. ``mb`` counts micro-batches within a direction
    from 0 (for DualPipeV both chunks use the same index). ``stage`` is the model stage index
    along the micro-batch's route. ``overlap`` marks an F that runs as one unit with the
    backward that follows it on the same rank (DeepSeek's overlapped F&B).
    """

    op: str
    dir: int
    mb: int
    stage: int
    overlap: bool = False

    @property
    def is_backward(self) -> bool:
        return self.op in (B, BW)

    def to_json(self) -> dict:
        return {"op": self.op, "dir": self.dir, "mb": self.mb, "stage": self.stage,
                **({"overlap": True} if self.overlap else {})}

    @staticmethod
    def from_json(d: dict) -> "Action":
        return Action(d["op"], int(d["dir"]), int(d["mb"]), int(d["stage"]), bool(d.get("overlap", False)))

    def __str__(self) -> str:
        # Short form in the spirit of torch.distributed.pipelining: "F0.3" is the forward of
        # micro-batch 3 of direction 0; a trailing "+" marks an F fused with the next backward.
        return f"{self.op}{self.dir}.{self.mb}{'+' if self.overlap else ''}"


RankActions = Tuple[Action, ...]


def units(acts: Sequence[Action]) -> List[Tuple[int, ...]]:
    """A rank's execution units: an overlapped F with its following backward is one unit, every
    other action is one (the executor runs a fused unit in one ``forward_backward`` call)."""
    out: List[Tuple[int, ...]] = []
    i = 0
    while i < len(acts):
        if acts[i].overlap:
            if i + 1 >= len(acts) or not acts[i + 1].is_backward:
                raise ValueError(f"action {i} ({acts[i]}) is marked overlap but no backward follows it")
            out.append((i, i + 1))
            i += 2
        else:
            out.append((i,))
            i += 1
    return out


def format_grid(ranks: Sequence[Iterable[Action]], mark: Tuple[int, int] | None = None) -> str:
    """Rank-by-step text grid; ``mark=(rank, index)`` brackets one action (used in errors)."""
    return "\n".join(f"rank {r:>2}: " + " ".join(f"[{a}]" if mark == (r, i) else str(a) for i, a in enumerate(acts))
                     for r, acts in enumerate(ranks))

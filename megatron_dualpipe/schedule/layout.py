"""Where each model stage lives, and the route a micro-batch takes through the stages: every other
module asks this one where a stage is, what comes before or after it, whether it has a mirrored copy.

* ``unidirectional`` (1F1B, ZB-H1): stage s on rank s.
* ``bidirectional`` (DualPipe): direction 0 has stage s on rank s, direction 1 on rank pp-1-s, so
  rank i holds stages i and pp-1-i (model[0] and model[1] of the Megatron integration).
* ``v`` (DualPipeV): one route of 2*pp stages folded into a V: stage s < pp on rank s, stage
  s >= pp on rank 2*pp-1-s; the turn at rank pp-1 stays on one rank.
* ``interleaved`` (Megatron's virtual pipeline of ``chunks``): stage s on rank s % pp, in model
  chunk (``dir``) s // pp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

UNIDIRECTIONAL = "unidirectional"
BIDIRECTIONAL = "bidirectional"
V_SHAPE = "v"
INTERLEAVED = "interleaved"

Hop = Tuple[int, int]  # (dir, stage)


@dataclass(frozen=True)
class Layout:
    kind: str
    pp: int
    #: Model chunks per rank of the interleaved layout (Megatron's virtual pipeline size).
    chunks: int = 1

    @property
    def directions(self) -> Tuple[int, ...]:
        if self.kind == INTERLEAVED:
            return tuple(range(self.chunks))
        return (0, 1) if self.kind != UNIDIRECTIONAL else (0,)

    @property
    def dir_word(self) -> str:
        """What ``Action.dir`` names in this layout: a direction, or (DualPipeV, interleaved) a model chunk."""
        return "chunk" if self.kind in (V_SHAPE, INTERLEAVED) else "direction"

    def dir_label(self, d: int) -> str:
        """The one name of ``dir`` value ``d``, used by every text and picture."""
        if self.kind == INTERLEAVED:
            return f"chunk {d} (stages {d * self.pp}-{(d + 1) * self.pp - 1})"
        if self.kind == V_SHAPE:
            first = self.stages(d)
            way = "down the ranks" if d == 0 else "back up"
            return f"chunk {d} (stages {first[0]}-{first[-1]}, {way})"
        if self.kind == BIDIRECTIONAL:
            return f"direction {d} (enters at rank {0 if d == 0 else self.pp - 1})"
        return f"direction {d}"

    @property
    def mirrored(self) -> bool:
        """Whether every stage has two copies, one per direction (DualPipe: stage s on rank s and on
        rank pp-1-s), whose gradients must be summed over the pair of ranks."""
        return self.kind == BIDIRECTIONAL

    def partner(self, rank: int) -> int:
        """The rank whose stages are ``rank``'s in the other direction: pp-1-rank (DualPipe: the
        rank holding the mirrored copies; the middle rank of an odd pipeline is its own)."""
        return self.pp - 1 - rank

    def stages_on(self, rank: int) -> Tuple[int, ...]:
        """The stage of each direction held by ``rank``: chunk ``d`` of its model is stage
        ``stages_on(rank)[d]`` (DualPipe (i, pp-1-i), DualPipeV (i, 2pp-1-i), 1F1B (i,))."""
        return tuple(self.stage_on(rank, d) for d in self.directions)

    def holder(self, stage: int) -> Tuple[int, int]:
        """(rank, direction) holding ``stage`` of a layout where each stage exists once along the
        route (unidirectional, V); DualPipe's stages have two holders: use :meth:`rank_of`."""
        if self.mirrored:
            raise ValueError(f"stage {stage} of a {self.kind} layout has a copy in each direction: "
                             f"ask rank_of(direction, stage)")
        d = 1 if self.kind == V_SHAPE and stage >= self.pp else 0
        return self.rank_of(d, stage), d

    def stages(self, d: int) -> range:
        if self.kind == INTERLEAVED:
            return range(d * self.pp, (d + 1) * self.pp)
        if self.kind == V_SHAPE and d == 1:
            return range(self.pp, 2 * self.pp)
        return range(self.pp)

    def rank_of(self, d: int, stage: int) -> int:
        """The rank that owns ``stage`` of direction ``d`` (outside interleaving, :meth:`stage_on`'s
        maps are their own inverses)."""
        return stage % self.pp if self.kind == INTERLEAVED else self.stage_on(stage, d)

    def stage_on(self, rank: int, d: int) -> int:
        """The stage of direction ``d`` held by ``rank``."""
        if self.kind == INTERLEAVED:
            return d * self.pp + rank
        if self.kind == BIDIRECTIONAL and d == 1:
            return self.pp - 1 - rank
        if self.kind == V_SHAPE and d == 1:
            return 2 * self.pp - 1 - rank
        return rank

    def next_hop(self, d: int, stage: int) -> Optional[Hop]:
        """The stage after (d, stage) on the micro-batch's route, or None at the loss."""
        if self.kind == INTERLEAVED:
            nxt = stage + 1
            return (nxt // self.pp, nxt) if nxt < self.chunks * self.pp else None
        if self.kind == V_SHAPE:  # chunk 1 from stage pp on
            return (int(stage + 1 >= self.pp), stage + 1) if stage + 1 < 2 * self.pp else None
        return (d, stage + 1) if stage + 1 < self.pp else None

    def prev_hop(self, d: int, stage: int) -> Optional[Hop]:
        """The stage before (d, stage), or None where the micro-batch is read from data."""
        if self.kind == INTERLEAVED:
            return ((stage - 1) // self.pp, stage - 1) if stage > 0 else None
        if self.kind == V_SHAPE:
            return (int(stage - 1 >= self.pp), stage - 1) if stage > 0 else None
        return (d, stage - 1) if stage > 0 else None

    def is_first(self, d: int, stage: int) -> bool:
        return self.prev_hop(d, stage) is None

    def is_last(self, d: int, stage: int) -> bool:
        return self.next_hop(d, stage) is None

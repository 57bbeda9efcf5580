"""How a mirrored schedule sums a stage's two copies: the ways, declared once, and their pure facts
(how they run under megatron-core: ``mcore.copies``). :func:`stage_order` is the one order both partners
issue the collectives outside the schedule in: ascending stage. Standard library only.
"""
from __future__ import annotations

from enum import Enum
from typing import Callable, List, Optional, Tuple

from .layout import Layout
from .lowering.ops import Op, coll


def stage_order(layout: Layout, rank: int) -> List[int]:
    """``rank``'s chunks in ascending stage order on a mirrored layout, else in chunk order."""
    chunks = range(len(layout.directions))
    return sorted(chunks, key=lambda c: layout.stage_on(rank, c)) if layout.mirrored else list(chunks)


def paired(layout: Layout, rank: int) -> bool:
    """A mirrored layout's rank whose partner holds its stages' other copies (not an odd pipeline's middle)."""
    return layout.mirrored and layout.partner(rank) != rank


def _gathers(kind: str, key, group: str, moe: bool) -> List[Op]:
    """A dense collective and, with experts, its expert twin (``expt-`` group)."""
    return [coll(f"{kind}:{key}", group)] + ([coll(f"expert-{kind}:{key}", f"expt-{group}")] if moe else [])


class CopySum(str, Enum):
    """``bd-first``: the pair sums whole buffers during the schedule, then each copy reduces over dp;
    ``dp-first``: each copy reduce-scatters, then the pair sums the shards in Megatron's finalize;
    ``shared-shard``: both copies' ranks are one shard group, whose reduce-scatter sums them."""

    BD_FIRST = "bd-first"
    DP_FIRST = "dp-first"
    SHARED_SHARD = "shared-shard"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def chosen_by(cls, flag_set: Callable[[str], bool], default: str) -> "CopySum":
        """The way whose training flag ``flag_set`` says is on, else ``default``."""
        return next((way for way in cls if way.flag is not None and flag_set(way.flag)), cls(default))

    def on(self, layout: Layout) -> "CopySum":
        """The way that runs on ``layout``: one without copies sums nothing (``bd-first``)."""
        return self if layout.mirrored else CopySum.BD_FIRST

    @property
    def sums_in_schedule(self) -> bool:
        return self is CopySum.BD_FIRST

    @property
    def stage_ordered(self) -> bool:
        """Megatron's finalize issues the sums chunk by chunk: it gets the chunks in :func:`stage_order`."""
        return self is not CopySum.BD_FIRST

    @property
    def shards_over_both_copies(self) -> bool:
        """The optimizer shards a stage over both copies' ranks: it needs the distributed optimizer,
        keeps 1F1B's optimizer state, and reduces after the schedule (no ``--overlap-grad-reduce``)."""
        return self is CopySum.SHARED_SHARD

    @property
    def flag(self) -> Optional[str]:
        """Training's flag that chooses it (None: the default)."""
        flags = {CopySum.DP_FIRST: "--dualpipe-dp-first", CopySum.SHARED_SHARD: "--dualpipe-shared-shard-group"}
        return flags.get(self)

    @property
    def words(self) -> str:
        return {CopySum.BD_FIRST: "the default: the pair of ranks sums each stage's two copies, then data parallel",
                CopySum.DP_FIRST: "data-parallel reduce-scatter first, then the pair sums the shards",
                CopySum.SHARED_SHARD: "both copies in one distributed-optimizer group"}[self]

    @property
    def memory_words(self) -> str:
        return ", optimizer state as 1F1B's" if self.shards_over_both_copies else ""

    def pair_sum_bytes(self, chunk_bytes: float, dp: int, distributed_optimizer: bool) -> float:
        """What a bd pair's sum of a chunk moves (dp-first with the distributed optimizer: a 1/dp shard)."""
        return chunk_bytes / dp if self is CopySum.DP_FIRST and distributed_optimizer else chunk_bytes

    def finalize_order(self, layout: Layout, rank: int) -> List[int]:
        """The chunks in the order Megatron's finalize gets them."""
        return stage_order(layout, rank) if self.on(layout).stage_ordered else list(range(len(layout.directions)))

    def grad_syncs(self, layout: Layout, r: int, *, moe: bool, dp: int, overlap: bool) -> List[Op]:
        """``finish_grad_sync`` per chunk: the reduction without overlap (the shared shard group's over
        its stage's groups), then dp-first's sum of the shards over the bd pair."""
        way, out = self.on(layout), []
        for c in way.finalize_order(layout, r):
            s = layout.stage_on(r, c)
            if way is CopySum.SHARED_SHARD:
                out += _gathers("reduce-scatter", s, f"shard:{s}", moe)
                continue
            out += _gathers("grad-sync", c, "dp", moe) if not overlap and dp > 1 else []
            out += [coll(f"shard-sum:{s}", "bd")] if way is CopySum.DP_FIRST and paired(layout, r) else []
        return out

    def sub_optimizers(self, layout: Layout, r: int, moe: bool) -> List[Tuple[bool, List[int]]]:
        """(expert, chunks) of each optimizer of the chain, in step order: dense then experts; the
        shared shard group's one pair per stage, in stage order."""
        parts = [False, True] if moe else [False]
        if self.on(layout) is CopySum.SHARED_SHARD:
            return [(expert, [c]) for c in stage_order(layout, r) for expert in parts]
        return [(expert, list(range(len(layout.directions)))) for expert in parts]

    def param_gathers(self, layout: Layout, r: int, c: int, *, moe: bool, dp: int) -> List[Op]:
        """``start_param_sync`` of chunk ``c``: its dense, then its expert bucket groups' all-gathers."""
        if self.on(layout) is CopySum.SHARED_SHARD:
            s = layout.stage_on(r, c)
            return _gathers("param-gather", s, f"shard:{s}", moe)
        return _gathers("param-gather", c, "dp", moe) if dp > 1 else []


BD_FIRST, DP_FIRST, SHARED_SHARD = CopySum.BD_FIRST, CopySum.DP_FIRST, CopySum.SHARED_SHARD
#: Every way, the default first.
WAYS: Tuple[CopySum, ...] = tuple(CopySum)

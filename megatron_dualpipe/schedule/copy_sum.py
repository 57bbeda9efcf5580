"""How a mirrored schedule sums a stage's two copies: the three ways and their pure facts.

DualPipe holds every stage twice (``Layout.mirrored``: stage s on rank s and on rank pp-1-s); the
two copies' gradients must be summed before the optimizer steps. :class:`CopySum` names the ways
once (the cost model's ``bd_mode``, ``advise --bd-reduction``, ``StepOptions.copy_sum``) and
answers what follows from the choice without torch: whether the sum runs during the schedule,
the order the chunks are finalized in, the bytes a pair sums, and the collectives it adds after
the schedule (``step_collectives``). How each way runs under megatron-core is ``mcore.copies``.

:func:`stage_order` is the one rule for the order both partners issue the collectives outside the
schedule in (the sums in finalize, the shard groups' gathers, checkpoint gathers, drift checks):
ascending stage, so rank i and pp-1-i both start with stage min(i, pp-1-i).

Standard library only.
"""
from __future__ import annotations

from enum import Enum
from typing import Callable, List, Optional, Tuple

from .layout import Layout
from .lowered import COLL, Op


def stage_order(layout: Layout, rank: int) -> List[int]:
    """``rank``'s chunks in ascending stage order on a mirrored layout, else in chunk order."""
    chunks = range(len(layout.directions))
    return sorted(chunks, key=lambda c: layout.stage_on(rank, c)) if layout.mirrored else list(chunks)


def paired(layout: Layout, rank: int) -> bool:
    """A mirrored layout's rank with a partner holding its stages' other copies (not an odd
    pipeline's middle rank, which holds both)."""
    return layout.mirrored and layout.partner(rank) != rank


def _coll(what: str, group: str) -> Op:
    return Op(COLL, what=what, group=group)


class CopySum(str, Enum):
    """One way of summing the copies; its value is the text the options and the cost model use.

    ``bd-first``: the pair sums each copy's whole buffers during the schedule (``GradReduction``),
    then each copy reduces over its data-parallel replicas; ``dp-first`` (``--dualpipe-dp-first``):
    each copy reduce-scatters first and the pair sums the shards in Megatron's finalize;
    ``shared-shard`` (``--dualpipe-shared-shard-group``): both copies' ranks are one shard group,
    whose reduce-scatter sums them."""

    BD_FIRST = "bd-first"
    DP_FIRST = "dp-first"
    SHARED_SHARD = "shared-shard"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    @classmethod
    def parse(cls, text: str) -> "CopySum":
        """The way named ``text``; ValueError naming the ways."""
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"bd_mode must be one of {', '.join(w.value for w in cls)}, got {text!r}") from None

    @classmethod
    def chosen_by(cls, flag_set: Callable[[str], bool], default: str) -> "CopySum":
        """The way whose training flag ``flag_set`` says is on, else ``default``."""
        return next((way for way in cls if way.flag is not None and flag_set(way.flag)), cls(default))

    def on(self, layout: Layout) -> "CopySum":
        """The way that runs on ``layout``: a layout without copies sums nothing (``bd-first``)."""
        return self if layout.mirrored else CopySum.BD_FIRST

    @property
    def sums_in_schedule(self) -> bool:
        """The bd sum runs during the schedule (``grad_reduction.GradReduction``)."""
        return self is CopySum.BD_FIRST

    @property
    def stage_ordered(self) -> bool:
        """Megatron's finalize issues the collectives that sum the copies, chunk by chunk: it gets the
        chunks in :func:`stage_order`, the order both partners then share."""
        return self is not CopySum.BD_FIRST

    @property
    def shards_over_both_copies(self) -> bool:
        """The optimizer shards a stage over both copies' ranks (twice 1F1B's data-parallel ranks)."""
        return self is CopySum.SHARED_SHARD

    def needs_distributed_optimizer(self) -> bool:
        return self is CopySum.SHARED_SHARD

    @property
    def overlaps_grad_reduce(self) -> bool:
        """Training can start the reduction during the schedule (the shared shard group's
        reduce-scatters run after it: refused with ``--overlap-grad-reduce``)."""
        return self is not CopySum.SHARED_SHARD

    @property
    def flag(self) -> Optional[str]:
        """Training's flag that chooses it (None: the default)."""
        return _FLAGS[self]

    @property
    def words(self) -> str:
        return _WORDS[self]

    @property
    def memory_words(self) -> str:
        """What it changes in the optimizer state's memory, as a suffix to :attr:`words`."""
        return ", optimizer state as 1F1B's" if self.shards_over_both_copies else ""

    def pair_sum_bytes(self, chunk_bytes: float, dp: int, distributed_optimizer: bool) -> float:
        """What one bd pair's sum of a chunk moves: whole buffers, or (dp-first with the distributed
        optimizer) the rank's 1/dp shard; the shared shard group's sum is its reduce-scatter."""
        if self is CopySum.DP_FIRST and distributed_optimizer:
            return chunk_bytes / dp
        return 0.0 if self is CopySum.SHARED_SHARD else chunk_bytes

    def finalize_order(self, layout: Layout, rank: int) -> List[int]:
        """The chunks in the order Megatron's finalize gets them."""
        return stage_order(layout, rank) if self.on(layout).stage_ordered else list(range(len(layout.directions)))

    def grad_syncs(self, layout: Layout, r: int, *, moe: bool, dp: int, overlap: bool) -> List[Op]:
        """Megatron's ``finish_grad_sync`` per chunk as rank ``r`` issues it: the reduction itself
        without overlap (over the stage's shard groups for the shared shard group), then dp-first's
        sum of the shards over the bd pair."""
        way, out = self.on(layout), []
        for c in way.finalize_order(layout, r):
            s = layout.stage_on(r, c)
            if way is CopySum.SHARED_SHARD:
                out += _over_shard_groups("reduce-scatter", s, moe)
                continue
            if not overlap and dp > 1:
                out += [_coll(f"grad-sync:{c}", "dp")] + ([_coll(f"expert-grad-sync:{c}", "expt-dp")] if moe else [])
            if way is CopySum.DP_FIRST and paired(layout, r):
                out.append(_coll(f"shard-sum:{s}", "bd"))
        return out

    def sub_optimizers(self, layout: Layout, r: int, moe: bool) -> List[Tuple[bool, List[int]]]:
        """(expert, chunks) of each optimizer of the chain, in step order: dense then experts; under
        the shared shard group one pair per stage, in stage order."""
        parts = [False, True] if moe else [False]
        if self.on(layout) is CopySum.SHARED_SHARD:
            return [(expert, [c]) for c in stage_order(layout, r) for expert in parts]
        return [(expert, list(range(len(layout.directions)))) for expert in parts]

    def param_gathers(self, layout: Layout, r: int, c: int, *, moe: bool, dp: int) -> List[Op]:
        """``start_param_sync`` of chunk ``c``: its dense, then its expert bucket groups' all-gathers."""
        if self.on(layout) is CopySum.SHARED_SHARD:
            return _over_shard_groups("param-gather", layout.stage_on(r, c), moe)
        if dp == 1:
            return []
        return [_coll(f"param-gather:{c}", "dp")] + ([_coll(f"expert-param-gather:{c}", "expt-dp")] if moe else [])


def _over_shard_groups(kind: str, stage: int, moe: bool) -> List[Op]:
    return [_coll(f"{kind}:{stage}", f"shard:{stage}")] + (
        [_coll(f"expert-{kind}:{stage}", f"expt-shard:{stage}")] if moe else [])


_FLAGS = {CopySum.BD_FIRST: None, CopySum.DP_FIRST: "--dualpipe-dp-first",
          CopySum.SHARED_SHARD: "--dualpipe-shared-shard-group"}
_WORDS = {CopySum.BD_FIRST: "the default: the pair of ranks sums each stage's two copies, then data parallel",
          CopySum.DP_FIRST: "data-parallel reduce-scatter first, then the pair sums the shards",
          CopySum.SHARED_SHARD: "both copies in one distributed-optimizer group"}
BD_FIRST, DP_FIRST, SHARED_SHARD = CopySum.BD_FIRST, CopySum.DP_FIRST, CopySum.SHARED_SHARD
#: Every way, the default first.
WAYS: Tuple[CopySum, ...] = tuple(CopySum)

__all__ = ["CopySum", "WAYS", "BD_FIRST", "DP_FIRST", "SHARED_SHARD", "stage_order", "paired"]

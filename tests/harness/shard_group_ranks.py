"""The shared shard group: both copies of a DualPipe stage as one distributed-optimizer group.

DualPipe keeps stage ``s`` twice: on pipeline rank ``s`` as ``model[0]`` (its *home* copy) and
on pipeline rank ``pp-1-s`` as ``model[1]`` (its *mirror*). Megatron's distributed optimizer
shards a stage's gradients and optimizer state over its data-parallel group (``dp x cp`` ranks
with context parallelism, Megatron's ``intra_dp_cp`` group). With the shared shard group
(issue 18 item 4, ``docs/design-shared-shard-group.md``) chunk ``c`` of a rank is reduce-
scattered, stepped and all-gathered over the ``2 x dp x cp`` ranks that hold either copy of its
stage with the same tensor-parallel coordinates: the bd sum becomes part of the reduce-scatter
and each rank keeps ``1/(2 dp cp)`` of each of its two stages, 1F1B's ``1/(dp cp)`` in all.

:func:`shared_shard_group` gives the ranks of that group for one (global rank, chunk), in the
order the process group is built with (``new_group(..., sort_ranks=False)``): the home copy's
ranks first, then the mirror's, each part ascending (Megatron's own data-parallel groups are
ascending). The order fixes which shard a rank owns (its group rank), so the home copy's
data-parallel rank 0 is group rank 0: the rank Megatron gathers to when it writes a legacy
checkpoint or a ``fully_reshardable`` one, and the rank DDP broadcasts the parameters from.
:func:`all_shared_shard_groups` lists every distinct group once, in the same order on every rank
(``new_group`` is collective over the world). Expert layers use the same rule on Megatron's
expert rank generator (``tp`` = expert tensor parallel, ``cp`` = 1, ``ep``, ``dp`` = expert data
parallel): :func:`expert_order`.

The rank formula the tests hold ``mcore.shard_groups`` (which builds the groups from megatron-core's
own) and the collective-order checks against. Standard library only.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

from megatron_dualpipe.schedule.iteration_plan import Collective
from megatron_dualpipe.schedule.placement import DEFAULT_ORDER, RankOrder

#: The axes a shared shard group spans (Megatron's gradient group is data x context parallel).
_SPANNED = ("dp", "cp")


class ShardGroupError(ValueError):
    """A shared shard group cannot be formed for this configuration (the message names the fix)."""


def stage_of(pp: int, pp_rank: int, chunk: int) -> int:
    """The stage DualPipe puts in ``chunk`` of pipeline rank ``pp_rank``: ``model[0]`` holds
    stage ``pp_rank``, ``model[1]`` the mirror of stage ``pp-1-pp_rank`` (``Layout.stage_on``)."""
    if chunk not in (0, 1):
        raise ShardGroupError(f"a DualPipe rank has chunks 0 and 1, got chunk {chunk!r}")
    return pp_rank if chunk == 0 else pp - 1 - pp_rank


def _check(ranks: RankOrder) -> None:
    if ranks.pp % 2:
        raise ShardGroupError(f"the shared shard group pairs pipeline ranks i and pp-1-i, which needs an even pipeline "
                              f"size, got pp={ranks.pp}: use an even --pipeline-model-parallel-size")


def shared_shard_group(ranks: RankOrder, rank: int, chunk: int) -> Tuple[int, ...]:
    """Global ranks of the shared shard group of ``chunk`` on global ``rank`` (module docstring):
    the home copy's data x context-parallel ranks of its stage, then the mirror's."""
    _check(ranks)
    if not 0 <= rank < ranks.world:
        raise ShardGroupError(f"global rank {rank} is outside the world of {ranks.world} ranks")
    me = ranks.coords(rank)
    stage = stage_of(ranks.pp, me["pp"], chunk)
    fixed = {a: v for a, v in me.items() if a not in _SPANNED and a != "pp"}
    out: List[int] = []
    for pp_rank in (stage, ranks.pp - 1 - stage):  # home copy first, then the mirror
        part = [ranks.global_rank(**fixed, pp=pp_rank, dp=d, cp=c)
                for d in range(ranks.sizes["dp"]) for c in range(ranks.sizes["cp"])]
        out += sorted(part)
    return tuple(out)


def all_shared_shard_groups(ranks: RankOrder) -> List[Tuple[int, ...]]:
    """Every distinct shared shard group of the world, each once, ordered by (stage, first rank):
    the order in which every rank must create them."""
    _check(ranks)
    found: Dict[Tuple[int, ...], int] = {}
    for g in range(ranks.world):
        for c in (0, 1):
            group = shared_shard_group(ranks, g, c)
            found.setdefault(group, stage_of(ranks.pp, ranks.pp_rank(g), c))
    return sorted(found, key=lambda grp: (found[grp], grp))


def expert_order(etp: int, ep: int, edp: int, pp: int, order: str = DEFAULT_ORDER) -> RankOrder:
    """Megatron's expert rank generator (its expert layers' groups) as a :class:`RankOrder`."""
    return RankOrder(tp=etp, cp=1, dp=edp, pp=pp, order=order, ep=ep)


def shard_collectives(ranks: RankOrder, issues: Mapping[int, Sequence[Tuple[int, int]]],
                      kind: str = "reduce-scatter") -> Dict[int, List[Collective]]:
    """Per global rank, its ``(chunk, bucket)`` collectives (in issue order) as
    :class:`.iteration_plan.Collective` over the chunk's shared shard group, keyed by
    (``kind``, stage, bucket): what ``iteration_plan.issued`` checks."""
    return {r: [Collective(shared_shard_group(ranks, r, c), (kind, stage_of(ranks.pp, ranks.pp_rank(r), c), b))
                for c, b in cs] for r, cs in issues.items()}


__all__ = ["ShardGroupError", "stage_of", "shared_shard_group", "all_shared_shard_groups", "expert_order",
           "shard_collectives"]

"""Process groups for DualPipe on top of megatron-core's ``parallel_state``.

Per pipeline group ``[r_0, ..., r_{pp-1}]``: the **bd groups** (bidirectional pairs) ``{r_i, r_{pp-1-i}}``,
whose ranks hold each other's stage as a mirror (the middle rank of an odd pipeline is its own partner, with no
group: callers copy / sum locally), and the **reversed pipeline group**, the same ranks reversed
(``new_group(sort_ranks=False)``, checked at build time) so that ``group.rank() == pp-1-i``: ``model[1]``'s
``pg_collection.pp`` for construction-time rank queries only. ``new_group`` is collective over the world, so
every rank enumerates every pipeline group in one order; the groups live in one module-level registry, as
``parallel_state`` keeps its own.
"""
from __future__ import annotations

import types
from typing import List, Optional

import torch.distributed as dist

__all__ = ["build_bd_groups", "bd_groups_initialized", "destroy_bd_groups", "get_bd_group", "get_bd_mirror_rank",
           "get_bd_ranks", "get_reversed_pp_group", "get_pp_global_ranks"]


def _registry(**built) -> types.SimpleNamespace:
    """This rank's view of the groups `build_bd_groups` built: its pipeline group in order, its bd group (None on
    the middle rank of an odd pipeline) and ranks (sorted by pipeline rank), partner, reversed pipeline group."""
    return types.SimpleNamespace(**{**dict(initialized=False, pp_ranks=[], bd_group=None, bd_ranks=[],
                                           mirror_rank=None, reversed_pp_group=None), **built})


_REGISTRY = _registry()


class BDGroupsNotInitializedError(RuntimeError):
    """Raised by the accessors when `build_bd_groups` has not run (or was destroyed)."""


def _require() -> types.SimpleNamespace:
    if not _REGISTRY.initialized:
        raise BDGroupsNotInitializedError("DualPipe bd groups are not initialized: call "
                                          "megatron_dualpipe.mcore.groups.build_bd_groups() after "
                                          "parallel_state.initialize_model_parallel(...)")
    return _REGISTRY


def build_bd_groups(*, timeout=None, backend=None) -> None:
    """Create the bd groups and the reversed pipeline groups (collective over all ranks), once, after
    ``parallel_state.initialize_model_parallel`` and before ``model.build_two_direction_model``.
    ``timeout`` / ``backend`` go to ``torch.distributed.new_group``."""
    from megatron.core import parallel_state

    from .. import versions

    if _REGISTRY.initialized:
        raise RuntimeError("DualPipe bd groups are already initialized (destroy_bd_groups() first)")
    problem = versions.torch_problem()
    if problem:  # the launcher and the selftest say so before any process starts; direct callers here
        raise RuntimeError(f"DualPipe's process groups: {problem}")
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_bd_groups() needs megatron-core's parallel groups: call "
                           "parallel_state.initialize_model_parallel(...) first")
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if isinstance(pp_group, list):
        raise NotImplementedError("this rank belongs to several pipeline groups (heterogeneous encoder/decoder "
                                  "pipelines); DualPipe supports one pipeline group per rank")
    my_ranks = dist.get_process_group_ranks(pp_group)
    me = dist.get_rank()
    pp = len(my_ranks)
    kwargs = dict(timeout=timeout, backend=backend)

    world = dist.get_world_size()
    gathered: List[Optional[List[int]]] = [None] * world
    dist.all_gather_object(gathered, list(my_ranks))
    distinct = sorted({tuple(g) for g in gathered})  # every pipeline group, in the same order on every rank
    if sorted(r for g in distinct for r in g) != list(range(world)):
        raise RuntimeError(f"pipeline groups do not partition the world (world size {world}): {distinct}")
    reg = _registry(pp_ranks=list(my_ranks))
    for ranks in map(list, distinct):
        if len(ranks) != pp:
            raise RuntimeError(f"pipeline groups of different sizes: {ranks} vs {my_ranks}")
        # Reversed pipeline group: group rank pp-1-i on pipeline rank i.
        rev = dist.new_group(list(reversed(ranks)), sort_ranks=False, use_local_synchronization=False,
                             group_desc="DUALPIPE_REVERSED_PIPELINE_GROUP", **kwargs)
        if me in ranks:
            reg.reversed_pp_group = rev
        # bd pairs, outermost first.
        for i in range(pp // 2):
            pair = [ranks[i], ranks[pp - 1 - i]]
            g = dist.new_group(pair, use_local_synchronization=False, group_desc="DUALPIPE_BD_GROUP", **kwargs)
            if me in pair:
                reg.bd_group, reg.bd_ranks = g, pair
                reg.mirror_rank = pair[1] if me == pair[0] else pair[0]
    if reg.mirror_rank is None:  # odd pp: the middle rank mirrors itself
        reg.mirror_rank, reg.bd_ranks = me, [me]

    i = my_ranks.index(me)
    got = reg.reversed_pp_group.rank()
    if got != pp - 1 - i or dist.get_process_group_ranks(reg.reversed_pp_group) != list(reversed(my_ranks)):
        raise RuntimeError(f"torch.distributed.new_group(sort_ranks=False) did not keep the rank order "
                           f"(pipeline rank {i} got group rank {got}, expected {pp - 1 - i}); this torch "
                           f"version cannot build the reversed pipeline group")
    reg.initialized = True
    globals()["_REGISTRY"] = reg


def bd_groups_initialized() -> bool:
    """True between `build_bd_groups` and `destroy_bd_groups`."""
    return _REGISTRY.initialized


def destroy_bd_groups() -> None:
    """Forget the groups of `build_bd_groups` (local; like ``destroy_model_parallel``, only the references)."""
    global _REGISTRY
    _REGISTRY = _registry()


def get_bd_group():
    """This rank's bd group (2 ranks), or None on the middle rank of an odd pipeline."""
    return _require().bd_group


def get_bd_mirror_rank() -> int:
    """Global rank of the partner, pipeline rank pp-1-i (this rank itself in the middle of an odd pipeline)."""
    return _require().mirror_rank


def get_bd_ranks() -> List[int]:
    """Global ranks of this rank's bd pair, ordered by pipeline rank (one in the middle of an odd pipeline)."""
    return list(_require().bd_ranks)


def get_reversed_pp_group():
    """This rank's pipeline group with reversed rank order (group rank pp-1-i on rank i)."""
    return _require().reversed_pp_group


def get_pp_global_ranks() -> List[int]:
    """Global ranks of this rank's (physical) pipeline group, in pipeline order."""
    return list(_require().pp_ranks)

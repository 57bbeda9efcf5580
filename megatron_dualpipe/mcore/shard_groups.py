"""The shared shard group's process groups, and the scope in which megatron-core sees them.

With ``--dualpipe-shared-shard-group`` (docs/design-shared-shard-group.md) chunk ``c`` is reduce-scattered,
stepped and all-gathered over the ranks holding either copy of its stage: the optimizer keeps 1F1B's ``1/dp``
and the reduce-scatter sums the copies. Chunk 0's group is this rank's own data-parallel group (dense, expert)
followed by its members' bd partners, chunk 1's the other way round. :func:`partial_groups_of` answers only
the *partial* data-parallel getters with it: the full group keeps size ``dp``, so DDP still scales by ``1/dp``
and the optimizer's instance id stays 0.
"""
from __future__ import annotations

import contextlib
import types
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import hooks

__all__ = ["build_shard_groups", "shard_groups_initialized", "partial_groups_of", "chunk_of"]

#: This rank's shard groups per (kind, chunk): ``ranks``, ``groups`` (default backend), ``gloo`` (twins).
_REGISTRY: Optional[types.SimpleNamespace] = None
DENSE, EXPERT = "dense", "expert"


def _replicate(getter) -> dict:
    """core_v0.19.0's getters default to the data-distribution group (``with_gtp_remat=True``); a
    gradient buffer reduces over the replicate group (``False``; the same group unless
    ``--tensor-parallel-num-weight-shards``, refused with the flag). 0.16.1's have no such axis."""
    import inspect

    return {"with_gtp_remat": False} if "with_gtp_remat" in inspect.signature(getter).parameters else {}


def _own_groups() -> Dict[str, List[int]]:
    """This rank's megatron-core groups the gradient buffers reduce over: dense and expert (megatron-
    core builds the expert groups with or without experts; DDP asks for both)."""
    from megatron.core import parallel_state as ps

    dense, expert = ps.get_data_parallel_group, ps.get_expert_data_parallel_group
    ranks = dist.get_process_group_ranks
    return {DENSE: ranks(dense(with_context_parallel=True, partial_data_parallel=True, **_replicate(dense))),
            EXPERT: ranks(expert(partial_expert_data_parallel=True, **_replicate(expert)))}


def build_shard_groups(*, timeout=None) -> None:
    """Create every shared shard group (collective over the world; after ``build_bd_groups``,
    before the chunks are wrapped in DDP). The middle rank of an odd pipeline has no partner:
    refused (the argument check refuses odd pipelines first)."""
    from . import groups

    global _REGISTRY
    if _REGISTRY is not None:
        raise RuntimeError("the shared shard groups are already built")
    me, partner = dist.get_rank(), groups.get_bd_mirror_rank()
    if partner == me:
        raise ValueError("--dualpipe-shared-shard-group pairs pipeline ranks i and pp-1-i, which needs an even "
                         "pipeline size: use an even --pipeline-model-parallel-size")
    world = dist.get_world_size()
    partners: List[Optional[int]] = [None] * world
    dist.all_gather_object(partners, partner)
    own = _own_groups()
    gathered: List[Optional[Dict[str, List[int]]]] = [None] * world
    dist.all_gather_object(gathered, own)
    # Chunk 0 of a rank: its group then the partners of its members; chunk 1: the other way round.
    mine: Dict[Tuple[str, int], Tuple[int, ...]] = {}
    every: Dict[Tuple[int, ...], None] = {}
    for rank, theirs in enumerate(gathered):
        for kind, members in theirs.items():
            home, mirror = sorted(members), sorted(partners[m] for m in members)
            every.setdefault(tuple(home + mirror), None)  # chunk 1's groups are other ranks' chunk 0's
            if rank == me:
                mine[(kind, 0)], mine[(kind, 1)] = tuple(home + mirror), tuple(mirror + home)
    registry = types.SimpleNamespace(ranks=mine, groups={}, gloo={})
    from megatron.core import parallel_state as ps

    try:
        gloo = ps.get_data_parallel_group_gloo(with_context_parallel=True, partial_data_parallel=True) is not None
    except AssertionError:
        gloo = False
    for ranks in sorted(every, key=lambda r: (len(r), r)):
        group = dist.new_group(list(ranks), sort_ranks=False, use_local_synchronization=False, timeout=timeout,
                               group_desc="DUALPIPE_SHARED_SHARD_GROUP")
        twin = dist.new_group(list(ranks), sort_ranks=False, use_local_synchronization=False, timeout=timeout,
                              backend="gloo", group_desc="DUALPIPE_SHARED_SHARD_GROUP_GLOO") if gloo else None
        for key, want in mine.items():
            if want == ranks:
                registry.groups[key], registry.gloo[key] = group, twin
    for key, ranks in mine.items():
        got = dist.get_process_group_ranks(registry.groups[key])
        if list(got) != list(ranks):
            raise RuntimeError(f"torch.distributed.new_group(sort_ranks=False) did not keep the rank order of the "
                               f"shared shard group {list(ranks)} (got {got}); this torch version cannot build it")
    _REGISTRY = registry


def shard_groups_initialized() -> bool:
    return _REGISTRY is not None


def _require() -> types.SimpleNamespace:
    if _REGISTRY is None:
        raise RuntimeError("the shared shard groups are not built: call mcore.shard_groups.build_shard_groups() "
                           "after build_bd_groups()")
    return _REGISTRY


def chunk_of(module: torch.nn.Module) -> int:
    """Which chunk of its rank ``module`` is (0: the home copy, 1: the mirror)."""
    from .model import chunk_info

    info = chunk_info(module)
    if info is None:
        raise RuntimeError("the shared shard group needs chunks built by build_two_direction_model")
    return int(info["direction"])


def _answering(orig, chunk: int, kind: str, gloo: bool, partial_key: str):
    reg = _require()

    def getter(*args, **kwargs):
        if kwargs.get(partial_key):
            found = (reg.gloo if gloo else reg.groups)[(kind, chunk)]
            return found if found is not None else orig(*args, **kwargs)  # no gloo twin: megatron's answer (None)
        return orig(*args, **kwargs)

    return getter


@contextlib.contextmanager
def partial_groups_of(chunk: int):
    """Within the block, ``parallel_state``'s partial (one distributed-optimizer instance) data-
    parallel getters, dense and expert, NCCL and gloo, answer with ``chunk``'s shard groups."""
    from megatron.core import parallel_state

    part = "scoped"
    swaps = [hooks.entry(part, name).made_by(
                 lambda orig, k=kind, g=gloo, key=key: _answering(orig, chunk, k, g, key), on=parallel_state)
             for name, kind, gloo, key in (
                 ("get_data_parallel_group", DENSE, False, "partial_data_parallel"),
                 ("get_data_parallel_group_gloo", DENSE, True, "partial_data_parallel"),
                 ("get_expert_data_parallel_group", EXPERT, False, "partial_expert_data_parallel"),
                 ("get_expert_data_parallel_group_gloo", EXPERT, True, "partial_expert_data_parallel"))]
    with hooks.scoped(*swaps):
        yield

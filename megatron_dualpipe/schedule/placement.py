"""Which Megatron global rank runs on which GPU: Megatron's own order, or the bd pairs side by side.

DualPipe sums each stage's two copies over its bd pair (pipeline ranks ``i`` and ``pp-1-i``) every
iteration. Megatron's order (``RankGenerator``, default ``tp-cp-ep-dp-pp``) puts a stage's ranks
in one block of consecutive global ranks, so stages ``i`` and ``pp-1-i`` are as far apart as can
be and their sum crosses nodes. torchrun numbers processes ``RANK = node_rank * nproc_per_node +
local_rank``; :func:`pair_placement` is the permutation the launcher applies (``--pair-placement``)
so that slot ``RANK`` becomes global rank ``perm[RANK]`` and every node holds complete bd pairs.
Which global rank has which tensor, data and pipeline rank is untouched.

Megatron's global rank is ``g = f + F * (pp_rank + pp * o)``, ``F`` the product of the sizes of
the axes before ``pp`` and ``o`` the index over those after it. Slots are filled ``U`` consecutive
``f`` of stage ``j``, then the same of stage ``pp-1-j``, for every pair ``j < pp/2``: ``U =
gpus_per_node/2`` when a stage's ``F`` ranks fill at least half a node, else ``U = F``. Rank 0
stays in slot 0; groups Megatron's order keeps on one node (tensor, context, expert parallel)
stay on one node, or the placement is refused (:func:`pair_problem`). Standard library only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

#: Megatron-LM's orders (``initialize_model_parallel``): the default and ``--use-tp-pp-dp-mapping``.
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"


class PlacementError(ValueError):
    """The bd pairs cannot be placed side by side in this configuration (the message names the fix)."""


@dataclass(frozen=True)
class RankOrder:
    """Megatron's global ranks of the dense layers (its decoder ``RankGenerator``: ``ep`` is 1 there,
    the expert generator has the same pipeline groups, which Megatron asserts). The expert layers'
    generator is the same order with ``tp`` = the expert tensor-parallel size, ``cp`` = 1, ``ep`` and
    ``dp`` = the expert data-parallel size (``tests/harness/shard_group_ranks.py`` uses it so)."""

    tp: int
    cp: int
    dp: int
    pp: int
    order: str = DEFAULT_ORDER
    ep: int = 1

    def __post_init__(self):
        for name in ("tp", "cp", "dp", "pp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise PlacementError(f"{name} must be a positive integer, got {v!r}")
        axes = self.axes
        if sorted(set(axes)) != sorted(axes) or not set(axes) <= {"tp", "cp", "ep", "dp", "pp"}:
            raise PlacementError(f"rank order {self.order!r}: expected the axes tp, cp, ep, dp, pp in some order "
                                 f"separated by '-', each once (Megatron's {DEFAULT_ORDER!r} or {TP_PP_DP_ORDER!r})")

    @property
    def axes(self) -> List[str]:
        names = self.order.lower().split("-")
        return names + [a for a in ("tp", "cp", "ep", "dp", "pp") if a not in names]  # RankGenerator appends

    @property
    def sizes(self) -> Dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp, "pp": self.pp}

    @property
    def world(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def below_pp(self) -> int:
        """``F``: how many consecutive global ranks share a pipeline rank (the stride of ``pp``)."""
        return math.prod(self.sizes[a] for a in self.axes[:self.axes.index("pp")])

    def coords(self, rank: int) -> Dict[str, int]:
        """Tensor, context, data and pipeline rank of Megatron global ``rank`` (its mixed radix)."""
        out = {}
        for a in self.axes:
            rank, out[a] = divmod(rank, self.sizes[a])
        return out

    def global_rank(self, **coords: int) -> int:
        g, stride = 0, 1
        for a in self.axes:
            g += coords.get(a, 0) * stride
            stride *= self.sizes[a]
        return g

    def pp_rank(self, rank: int) -> int:
        return (rank // self.below_pp) % self.pp


def _unit(gpus_per_node: int, below_pp: int) -> int:
    """``U``: consecutive ranks of one stage placed next to the same ranks of its partner."""
    return gpus_per_node // 2 if below_pp >= gpus_per_node // 2 else below_pp


def pair_problem(world_size: int, gpus_per_node: int, tp: int, cp: int, dp: int, pp: int,
                 rank_order: str = DEFAULT_ORDER, ep: int = 1, etp: Optional[int] = None) -> Optional[str]:
    """Why the bd pairs cannot be placed side by side (one sentence naming the fix), or None."""
    try:
        ranks = RankOrder(tp, cp, dp, pp, rank_order)
    except PlacementError as e:
        return str(e)
    for name, v in (("world_size", world_size), ("gpus_per_node", gpus_per_node), ("ep", ep), ("etp", etp or tp)):
        if not isinstance(v, int) or v < 1:
            return f"{name} must be a positive integer, got {v!r}"
    drop = "or drop --pair-placement"
    if ranks.world != world_size:
        return f"world size {world_size} is not tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} = {ranks.world}"
    if pp % 2:
        return (f"the bd pairs (pipeline ranks i and pp-1-i) need an even pipeline size, got pp={pp}: use an even "
                f"--pipeline-model-parallel-size, {drop}")
    if world_size % gpus_per_node:
        return (f"{world_size} ranks do not fill nodes of {gpus_per_node} GPUs: the world size must be a multiple of "
                f"the GPUs per node")
    if gpus_per_node % 2:
        return f"a node of {gpus_per_node} GPUs cannot hold both halves of a bd pair: needs an even GPU count, {drop}"
    f = ranks.below_pp
    unit = _unit(gpus_per_node, f)
    if unit < f and f % unit:
        return (f"one pipeline stage spans {f} consecutive ranks (the axes before pp in {rank_order!r}), not a "
                f"multiple of half a node ({unit} GPUs): the pairs cannot share nodes evenly; use a GPU count per "
                f"node whose half divides {f}, {drop}")
    if unit == f and gpus_per_node % (2 * f):
        return (f"a bd pair spans 2x{f} ranks, which does not divide a node of {gpus_per_node} GPUs: use a GPU "
                f"count per node that is a multiple of {2 * f}, {drop}")
    etp = etp or tp
    for what, size in (("tensor-parallel", tp), ("tensor x context parallel", tp * cp),
                       ("expert tensor x expert parallel", etp * ep)):
        # Megatron's order keeps such a group on one node when it fits in one; the pairs must not split it.
        if size <= gpus_per_node and gpus_per_node % size == 0 and unit % size:
            gpus = f"{unit} GPU{'s' if unit > 1 else ''}"
            return (f"placing the bd pairs side by side leaves {gpus} of a node per stage, which would split "
                    f"the {what} groups of {size} ranks across nodes: use a GPU count per node that is a multiple "
                    f"of {2 * size} (2 x {size}), a smaller group, {drop}")
    return None


def pair_placement(world_size: int, gpus_per_node: int, tp: int, cp: int, dp: int, pp: int,
                   rank_order: str = DEFAULT_ORDER, ep: int = 1, etp: Optional[int] = None) -> List[int]:
    """``perm[slot]``: the Megatron global rank the process in torchrun slot ``slot`` (its ``RANK``)
    becomes, so that every node of ``gpus_per_node`` slots holds complete bd pairs (module
    docstring). ``ep`` / ``etp`` only enter the check that expert groups stay on a node.
    Raises :class:`PlacementError` naming the fix (:func:`pair_problem`)."""
    problem = pair_problem(world_size, gpus_per_node, tp, cp, dp, pp, rank_order, ep, etp)
    if problem:
        raise PlacementError(problem)
    ranks = RankOrder(tp, cp, dp, pp, rank_order)
    f = ranks.below_pp
    unit = _unit(gpus_per_node, f)
    perm = [0] * world_size
    for g in range(world_size):
        below, rest = g % f, g // f
        stage, outer = rest % pp, rest // pp
        pair, side = (stage, 0) if stage < pp - 1 - stage else (pp - 1 - stage, 1)
        block, offset = divmod(below, unit)
        slot = offset + unit * (side + 2 * (block + (f // unit) * (pair + (pp // 2) * outer)))
        perm[slot] = g
    return perm


def megatron_placement(world_size: int) -> List[int]:
    """Megatron's own placement: slot ``s`` runs global rank ``s``."""
    return list(range(world_size))


def invert(perm: List[int]) -> List[int]:
    """``slot_of[global rank]`` for ``perm[slot] = global rank``."""
    return sorted(range(len(perm)), key=perm.__getitem__)

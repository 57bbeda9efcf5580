"""What the gradient communication and the P2P messages of a schedule cost, and how much of it shows.

After (and while) the schedule runs, every rank reduces its chunks' gradients; DualPipe reduces two stages' bytes
over data parallel and first sums each stage's two copies over the bd pair (ranks i and pp-1-i). This module times
them where ``mcore.grad_reduction.GradReduction`` starts them, from the simulation:

* a chunk's gradients are final at the end of its last gradient action (``lowering.reductions``);
* the pair's sums run one after the other in the order both partners issue them (``bd_sum_order``), each once both
  copies are final and the previous sum is done;
* each chunk's data-parallel reduction (a reduce-scatter with the distributed optimizer) starts at the plan's point
  (``dp_start_points``) after the previous one; the bd and dp communicators are separate queues, so they overlap;
* Megatron's own schedules with ``--overlap-grad-reduce`` start a chunk's reduction when its last backward ends
  (pessimistic by at most one backward).

A rank's exposed communication is how far its last reduction ends past the makespan; the iteration is the makespan
plus the largest exposure (the optimizer step waits for every rank). Links come from the placement
(:class:`Placement`: Megatron's order, or the launcher's ``--pair-placement``); collectives are rings.
Milliseconds, GB/s (1e9 bytes per second). Standard library only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable, Dict, List, Optional

from ..schedule.copy_sum import BD_FIRST, DP_FIRST, CopySum
from ..schedule.lowering import reductions as grad_order  # when a chunk is final; the pair's sum order
from ..schedule.placement import RankOrder, invert, megatron_placement, pair_placement

#: Bytes per gradient element.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Rank placements: Megatron's own order, or the launcher's ``--pair-placement``.
MEGATRON, PAIRED = "megatron", "paired"


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth per rank in GB/s (bus bandwidth), latency per message in ms."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self):
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"a link's bandwidth must be a finite number of GB/s > 0, got {self.bandwidth}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"a link's latency must be a finite number of ms >= 0, got {self.latency}")

    def transfer(self, nbytes: float) -> float:
        return nbytes / (self.bandwidth * 1e9) * 1e3


def all_reduce_ms(nbytes: float, n: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks: twice a reduce-scatter."""
    return 2 * reduce_scatter_ms(nbytes, n, link)


def reduce_scatter_ms(nbytes: float, n: int, link: Link) -> float:
    """A ring reduce-scatter of ``nbytes`` over ``n`` ranks (the distributed optimizer's)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * link.transfer(nbytes) + (n - 1) * link.latency


def p2p_ms(nbytes: float, link: Link) -> float:
    return link.latency + link.transfer(nbytes)


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a pp x dp x tp job sit; ``paired`` (``--pair-placement``) refuses with
    :class:`.placement.PlacementError` where the launcher would."""

    pp: int
    dp: int = 1
    tp: int = 1
    gpus_per_node: int = 8
    paired: bool = False

    def __post_init__(self):
        for name in ("pp", "dp", "tp", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.paired:
            self._slots  # refuse now, with the launcher's message

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def name(self) -> str:
        return PAIRED if self.paired else MEGATRON

    @cached_property
    def _slots(self) -> List[int]:
        """``slot_of[global rank]``: which torchrun slot (node = slot // gpus_per_node) runs it."""
        if not self.paired:
            return megatron_placement(self.world)
        return invert(pair_placement(self.world, self.gpus_per_node, self.tp, 1, self.dp, self.pp))

    @cached_property
    def _nodes(self) -> List[List[int]]:
        """``_nodes[pp_rank][dp_rank * tp + tp_rank]``: the node of every rank (asked per message), from its
        global rank in Megatron's order (which the placement does not change)."""
        order = RankOrder(self.tp, 1, self.dp, self.pp)
        return [[self._slots[order.global_rank(tp=t, dp=d, pp=r)] // self.gpus_per_node for d in range(self.dp)
                 for t in range(self.tp)] for r in range(self.pp)]

    def pp_ranks_cross_nodes(self, a: int, b: int) -> bool:
        """Whether pipeline ranks ``a`` and ``b`` (same dp and tp index) are on different nodes for
        some replica."""
        return self._nodes[a] != self._nodes[b]

    def dp_group_crosses_nodes(self, pp_rank: int) -> bool:
        return len({self._nodes[pp_rank][d * self.tp] for d in range(self.dp)}) > 1


@dataclass(frozen=True)
class Network:
    intra: Link
    inter: Link

    def link(self, crosses: bool) -> Link:
        return self.inter if crosses else self.intra


@dataclass(frozen=True)
class CommModel:
    """Everything the communication costs need. ``stage_grad_bytes``: one whole stage's gradient bytes on one rank
    (after tensor parallel; a chunk has its fraction); ``message_bytes``: one P2P message; ``distributed_optimizer``:
    the reduction is a reduce-scatter; ``overlap_grad_reduce`` False: every chunk reduces after the schedule."""

    placement: Placement
    network: Network
    stage_grad_bytes: float = 0.0
    message_bytes: float = 0.0
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    #: Measured links (``mcore.comm_probe``: the groups of a running job timed directly) take the
    #: place of the ones the placement picks.
    bd_link: Optional[Link] = None
    dp_link: Optional[Link] = None
    p2p_link: Optional[Link] = None
    bd_mode: str = BD_FIRST

    def __post_init__(self):
        if CopySum(self.bd_mode).shards_over_both_copies and not self.distributed_optimizer:
            raise ValueError(f"{self.bd_mode} shards the distributed optimizer's state over both copies")

    def with_inter_bandwidth(self, gbps: float) -> "CommModel":
        """The same job with ``gbps`` between nodes (measured links are taken as the inter-node ones)."""
        links = {k: (None if v is None else replace(v, bandwidth=gbps))
                 for k, v in (("bd_link", self.bd_link), ("dp_link", self.dp_link), ("p2p_link", self.p2p_link))}
        return replace(self, network=replace(self.network, inter=replace(self.network.inter, bandwidth=gbps)), **links)

    def with_placement(self, paired: bool) -> "CommModel":
        """The same job in Megatron's placement or with the bd pairs side by side (raises the
        launcher's ``PlacementError`` where the pairs cannot be placed so)."""
        return replace(self, placement=replace(self.placement, paired=paired))

    def for_schedule(self, has_bd_pairs: bool) -> "CommModel":
        """What a schedule gets: the launcher pairs ranks only for schedules with bd pairs
        (``--pair-placement`` refuses the others), so they run in Megatron's placement."""
        return self if has_bd_pairs or not self.placement.paired else self.with_placement(False)

    def p2p(self, src: int, dst: int) -> float:
        """One message from pipeline rank ``src`` to ``dst``."""
        link = self.p2p_link or self.network.link(self.placement.pp_ranks_cross_nodes(src, dst))
        return p2p_ms(self.message_bytes, link)

    def bd_sum(self, rank: int, nbytes: float) -> float:
        partner = self.placement.pp - 1 - rank
        if partner == rank:
            return 0.0
        link = self.bd_link or self.network.link(self.placement.pp_ranks_cross_nodes(rank, partner))
        return all_reduce_ms(nbytes, 2, link)

    def dp_reduce(self, rank: int, nbytes: float) -> float:
        link = self.dp_link or self.network.link(self.placement.dp_group_crosses_nodes(rank))
        dp = self.placement.dp
        return reduce_scatter_ms(nbytes, dp, link) if self.distributed_optimizer else all_reduce_ms(nbytes, dp, link)


@dataclass
class ChunkComm:
    """One chunk's gradient communication on one rank (ms from the iteration's start)."""

    chunk: int
    final: float
    bd_start: Optional[float] = None
    bd_end: Optional[float] = None
    dp_start: float = 0.0
    dp_end: float = 0.0


@dataclass
class GradComm:
    """Every rank's gradient communication for one simulated schedule."""

    makespan: float
    ranks: List[List[ChunkComm]]

    @property
    def exposed(self) -> List[float]:
        """Per rank: how far its gradient communication ends past the makespan."""
        return [max(0.0, max([c.dp_end for c in r] + [c.bd_end or 0.0 for c in r] + [0.0]) - self.makespan)
                for r in self.ranks]

    @property
    def iteration(self) -> float:
        return self.makespan + max(self.exposed, default=0.0)

    @property
    def bd_total(self) -> List[float]:
        return [sum((c.bd_end or 0.0) - (c.bd_start or 0.0) for c in r) for r in self.ranks]

    @property
    def dp_total(self) -> List[float]:
        return [sum(c.dp_end - c.dp_start for c in r) for r in self.ranks]


def grad_comm(schedule, sim, comm: CommModel, stage_fraction: float, deferring: bool,
              is_fake: Callable = lambda a: False) -> GradComm:
    """Time every rank's gradient communication for ``schedule`` simulated as ``sim``.
    ``stage_fraction``: a chunk's share of a stage; ``deferring``: B leaves the weight gradient to
    a W; ``comm.bd_mode``: how the two copies are combined (``schedule.copy_sum.CopySum``)."""
    ops = grad_order.grad_ops(deferring)
    pp = len(schedule.ranks)
    chunk_bytes = comm.stage_grad_bytes * stage_fraction
    finals = [{c: sim.ranks[r].ends[i] for c, i in grad_order.last_grad_action_index(acts, is_fake, ops).items()}
              for r, acts in enumerate(schedule.ranks)]
    orders = [[c for c in grad_order.completion_order(acts, is_fake, ops) if c in finals[r] or c in {a.dir for a in acts}]
              for r, acts in enumerate(schedule.ranks)]
    rows = [{c: ChunkComm(c, finals[r].get(c, sim.makespan)) for c in orders[r]} for r in range(pp)]
    end = [sim.ranks[r].ends[-1] if schedule.ranks[r] else 0.0 for r in range(pp)]  # of each rank's schedule
    mode = CopySum(comm.bd_mode).on(schedule.layout)

    def ready(r: int, c: int) -> float:
        return rows[r][c].final if comm.overlap_grad_reduce else max(rows[r][c].final, end[r])

    def dp_queue(r: int, after: Callable[[int], float], nbytes: float) -> None:
        t = 0.0
        for c in orders[r]:
            row = rows[r][c]
            row.dp_start = max(t, ready(r, c), after(c))
            row.dp_end = t = row.dp_start + comm.dp_reduce(r, nbytes)

    def pair_queue(r: int, partner: int, start_of: Callable[[int, int], float], cost: float, as_dp: bool) -> None:
        order = grad_order.bd_sum_order(schedule.ranks[r], schedule.ranks[partner], is_fake, ops, lower_rank=True)
        t = 0.0
        for c in order:
            start = max(t, start_of(r, c), start_of(partner, 1 - c))
            t = start + cost
            for rank, chunk in ((r, c), (partner, 1 - c)):
                row = rows[rank][chunk]
                if as_dp:
                    row.dp_start, row.dp_end = start, t
                else:
                    row.bd_start, row.bd_end = start, t

    pairs = [(r, pp - 1 - r) for r in range(pp) if r < pp - 1 - r] if schedule.layout.mirrored else []
    def planned(r: int, bd_sums: bool) -> Dict[int, float]:
        """When GradReduction starts each chunk's data-parallel reduction: after the action at the
        plan's point, or at the end of the rank's schedule and of its sums."""
        acts, ends = schedule.ranks[r], sim.ranks[r].ends
        finish = max([end[r]] + [rows[r][c].bd_end or 0.0 for c in orders[r]])
        points = grad_order.dp_start_points(schedule.layout, r, acts, is_fake, ops, bd_sums=bd_sums)
        return {c: ends[i] if i < len(acts) else finish for i, c in points}

    if mode == BD_FIRST:
        for r, partner in pairs:
            pair_queue(r, partner, ready, comm.bd_sum(r, chunk_bytes), as_dp=False)
        for r in range(pp):
            dp_queue(r, planned(r, True).__getitem__, chunk_bytes)
    elif mode == DP_FIRST:
        for r in range(pp):
            dp_queue(r, planned(r, False).__getitem__, chunk_bytes)
        shard = mode.pair_sum_bytes(chunk_bytes, comm.placement.dp, comm.distributed_optimizer)
        for r, partner in pairs:  # training's --dualpipe-dp-first sums the shards in Megatron's finalize, after it
            pair_queue(r, partner, lambda rank, c: max(rows[rank][c].dp_end, end[rank]), comm.bd_sum(r, shard),
                       as_dp=False)
    else:  # SHARED_SHARD: one reduce-scatter over both copies' 2 x dp replicas
        for r, partner in pairs:
            crosses = comm.placement.pp_ranks_cross_nodes(r, partner) or comm.placement.dp_group_crosses_nodes(r)
            link = comm.dp_link or comm.bd_link or comm.network.link(crosses)
            pair_queue(r, partner, ready, reduce_scatter_ms(chunk_bytes, 2 * comm.placement.dp, link), as_dp=True)
    return GradComm(sim.makespan, [[rows[r][c] for c in orders[r]] for r in range(pp)])

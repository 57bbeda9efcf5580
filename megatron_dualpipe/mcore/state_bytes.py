"""What a rank holds for its model, in bytes, against what Megatron's 1F1B would hold.

:func:`rank_bytes` counts on the built objects: each parameter and gradient storage once (DDP's buffers with
their padding: it is memory); the optimizer's main parameters where they are copies (a view into a model
parameter costs nothing) and its per-parameter state, from ``optimizer.state`` where it exists, else what the
first step will allocate. Each figure goes to its parameter's chunk, so 1F1B's is ``model[0]``'s share (as the
copy-sum way shards it); ``megatron_lm.training_hooks`` prints :func:`gather_table`'s table once.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import astuple, dataclass, field, fields
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from . import copies
from .copies import CopySumWay

#: Per-parameter state tensors the first step allocates, by optimizer class name (a torch or
#: Transformer Engine optimizer); None: not known, the state is counted only once it exists.
_MOMENTS = {"Adam": 2, "AdamW": 2, "FusedAdam": 2, "SGD": 1, "FusedSGD": 1}


@dataclass
class ChunkBytes:
    """One chunk's bytes on one rank. ``optimizer`` = main parameters + per-parameter state."""

    params: int = 0
    grads: int = 0
    main_params: int = 0
    optimizer_state: int = 0

    @property
    def optimizer(self) -> int:
        return self.main_params + self.optimizer_state

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def values(self) -> List[int]:
        return list(astuple(self))

    def __add__(self, other: "ChunkBytes") -> "ChunkBytes":
        return ChunkBytes(*(a + b for a, b in zip(self.values(), other.values())))


@dataclass
class RankBytes:
    """One rank's bytes per chunk; ``state_allocated``: the optimizer state was counted from
    ``optimizer.state`` (False: from what the first step allocates)."""

    chunks: List[ChunkBytes] = field(default_factory=list)
    state_allocated: bool = True

    @property
    def all(self) -> ChunkBytes:
        return sum(self.chunks, ChunkBytes())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> Tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _storages_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    seen: Dict[int, int] = {}
    for t in tensors:
        if t is not None:
            ptr, n = _storage(t)
            seen[ptr] = max(seen.get(ptr, 0), n)
    return sum(seen.values())


def _leaves(optimizer) -> Iterator:
    """The Megatron optimizers inside ``optimizer`` (a ``ChainedOptimizer`` holds several)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        for o in chained:
            yield from _leaves(o)
    elif optimizer is not None:
        yield optimizer


def _flat(groups) -> List:
    return [p for g in groups for p in g]


def main_params(optimizer) -> List[Tuple[torch.nn.Parameter, Optional[torch.Tensor]]]:
    """(model parameter, the tensor the inner optimizer steps on for it) for one Megatron optimizer,
    from its own lists: the distributed optimizer's shards, the mixed-precision optimizer's fp32
    copies, or the parameters themselves (``FP32Optimizer``)."""
    if hasattr(optimizer, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        halves = _flat(optimizer.shard_fp32_from_float16_groups)
        if any(t is None for t in halves):  # precision-aware: the optimizer steps on the bf16 shard
            halves = _flat(optimizer.shard_float16_groups)
        return (list(zip(_flat(optimizer.model_float16_groups), halves))
                + list(zip(_flat(optimizer.model_fp32_groups), _flat(optimizer.shard_fp32_groups))))
    if hasattr(optimizer, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        return (list(zip(_flat(optimizer.float16_groups), _flat(optimizer.fp32_from_float16_groups)))
                + [(p, p) for p in _flat(optimizer.fp32_from_fp32_groups)])
    inner = getattr(optimizer, "optimizer", optimizer)  # FP32Optimizer: the model's own parameters
    return [(p, p) for g in inner.param_groups for p in g["params"]]


def _moments(inner) -> Optional[int]:
    n = _MOMENTS.get(type(inner).__name__)
    if n is None:
        return None
    groups = getattr(inner, "param_groups", [])
    if n == 2 and any(g.get("amsgrad") for g in groups):
        return 3
    if n == 1 and not any(g.get("momentum") for g in groups):
        return 0
    return n


def rank_bytes(model: Sequence[torch.nn.Module], optimizer) -> RankBytes:
    """This rank's bytes per chunk of ``model`` (module docstring)."""
    out = RankBytes([ChunkBytes() for _ in model])
    chunk_of: Dict[int, int] = {}
    model_storages = set()
    for c, chunk in enumerate(model):
        params = list(chunk.parameters())
        for p in params:
            chunk_of[id(p)] = c
            model_storages.add(_storage(p)[0])
        out.chunks[c].params = _storages_bytes(params)
        out.chunks[c].grads = _storages_bytes(getattr(p, "main_grad", None) if getattr(p, "main_grad", None)
                                              is not None else p.grad for p in params)
    for leaf in _leaves(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if inner is None:  # a stub optimizer (no parameters on this rank)
            continue
        moments = _moments(inner)
        for param, main in main_params(leaf):
            if main is None or id(param) not in chunk_of:
                continue
            row = out.chunks[chunk_of[id(param)]]
            if _storage(main)[0] not in model_storages:
                row.main_params += _nbytes(main)
            state = inner.state.get(main) or {}
            if state:
                row.optimizer_state += sum(_nbytes(t) for t in state.values() if isinstance(t, torch.Tensor))
            else:  # what the first step allocates (an unknown optimizer's: counted as 0)
                out.state_allocated = False
                row.optimizer_state += (moments or 0) * _nbytes(main)
    return out


# -- the table rank 0 prints ------------------------------------------------------------------

#: One pipeline rank: the largest figures (``ChunkBytes``) over its tensor/context/data-parallel ranks.
TableRow = namedtuple("TableRow", "pp_rank mine one_f_one_b")


def _pack(pp_rank: int, rb: RankBytes, way: CopySumWay) -> List[int]:
    """This rank's figures, and 1F1B's: ``model[0]``'s share, as the way the copies are summed shards it."""
    home = way.one_f_one_b_bytes(rb.chunks[0] if rb.chunks else ChunkBytes())
    return [pp_rank, int(rb.state_allocated)] + rb.all.values() + home.values()


def rows_from(packed: Iterable[Sequence[int]]) -> Tuple[List[TableRow], bool]:
    """Rows per pipeline rank from every rank's packed figures (largest per column), and whether
    every rank counted its optimizer state from allocated tensors."""
    best: Dict[int, List[int]] = {}
    allocated = True
    n = len(fields(ChunkBytes))
    for v in packed:
        v = [int(x) for x in v]
        allocated &= bool(v[1])
        have = best.setdefault(v[0], v[2:])
        best[v[0]] = [max(a, b) for a, b in zip(have, v[2:])]
    return [TableRow(r, ChunkBytes(*v[:n]), ChunkBytes(*v[n:])) for r, v in sorted(best.items())], allocated


def gather_table(model, optimizer, pp_rank: int, group=None) -> Tuple[List[TableRow], bool]:
    """Every rank's :func:`rank_bytes` (collective over ``group``, default the world); the rows on
    every rank."""
    import torch.distributed as dist

    mine = torch.tensor(_pack(pp_rank, rank_bytes(model, optimizer), copies.of(model)), dtype=torch.int64)
    if "nccl" in str(dist.get_backend(group)):
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return rows_from(t.tolist() for t in every)


def _n(x: int) -> str:
    return f"{x:,}"


def format_table(schedule: str, rows: List[TableRow], allocated: bool, with_1f1b: bool = True,
                 way: CopySumWay = copies.WAYS[0]) -> str:
    """The table of :func:`gather_table`'s rows: bytes per pipeline rank, this schedule and 1F1B."""
    state = ("optimizer state counted from its tensors" if allocated else
             "optimizer state: main parameters counted, per-parameter state (Adam's two moments) as the first "
             "step will allocate it")
    lines = [f"[megatron-dualpipe] {schedule}: bytes per rank (largest over each pipeline rank's tensor, context "
             f"and data-parallel ranks; optimizer = main parameters + per-parameter state; {state})"]
    head = ["pp rank", "params", "grads", "optimizer", "total"]
    if with_1f1b:
        head += ["1f1b params", "1f1b grads", "1f1b optimizer", "1f1b total", "x 1f1b"]
    table = [head]
    for r in rows:
        cells = [str(r.pp_rank), _n(r.mine.params), _n(r.mine.grads), _n(r.mine.optimizer), _n(r.mine.total)]
        if with_1f1b:
            o = r.one_f_one_b
            ratio = f"{r.mine.total / o.total:.2f}" if o.total else "-"
            cells += [_n(o.params), _n(o.grads), _n(o.optimizer), _n(o.total), ratio]
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.append("  (1f1b: what Megatron's 1F1B holds in the same configuration: this rank's own stage, model[0], "
                 + way.one_f_one_b_note if with_1f1b else
                 "  (the two chunks are two different halves of the model's stages: nothing is duplicated)")
    return "\n".join(lines)

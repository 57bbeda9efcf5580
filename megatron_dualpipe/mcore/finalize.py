"""Gradient finalize for the two model chunks of DualPipe / DualPipeV: a DualPipe stage's gradient is the sum of
its two copies' (`allreduce_bd_grads`, or ``GradReduction`` during the schedule); tied embeddings are folded
locally, since Megatron's embedding-group all-reduce picks ``model[-1]`` on the last rank, a mirror here.
"""
from __future__ import annotations

import copy
import types
import weakref
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..executor import pair_sums
from . import bd_pairs
from .model import BIDIRECTIONAL, V_SHAPE, chunk_info, embedding_copy, unwrap_chunk
from . import copies

__all__ = ["allreduce_bd_grads", "allreduce_bd_router_statistics", "fold_tied_embedding_grads",
           "finalize_dualpipe_grads", "sum_tensors", "check_buffer_layouts", "NO_EMBEDDING_GROUP"]

BD_SUM_TIMEOUT_S = bd_pairs.BD_SUM_TIMEOUT_S


#: ``pg_collection.embd`` of size 1, so that megatron's finalize skips the word-embedding all-reduce (DualPipe
#: folds tied embeddings itself; ``embd=None`` makes megatron-core 0.16.1 fall back to parallel_state's group).
NO_EMBEDDING_GROUP = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def chunk_layout(model: Sequence[torch.nn.Module]) -> str:
    info = chunk_info(model[0]) if len(model) else None
    return info["layout"] if info is not None else BIDIRECTIONAL


def _grad_slot(param: torch.nn.Parameter) -> torch.Tensor:
    """``main_grad`` (Megatron DDP), else ``param.grad`` (zeros assigned when missing)."""
    g = getattr(param, "main_grad", None)
    if g is not None:
        return g
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _trainable(chunk: torch.nn.Module) -> List[torch.nn.Parameter]:
    return [p for p in unwrap_chunk(chunk).parameters() if p.requires_grad]


def allreduce_bd_grads(model: Sequence[torch.nn.Module]) -> None:
    """Sum the two copies of each stage's gradients over the bd pair now, both partners in stage
    order (the middle rank of an odd pipeline locally); a no-op for DualPipeV. Run it before any
    data-parallel reduction has started."""
    if chunk_layout(model) == V_SHAPE:
        return
    if len(model) != 2:
        raise ValueError(f"allreduce_bd_grads needs [model_dir0, model_dir1], got {len(model)} chunks")
    pos = bd_pairs.position()
    if pos.is_middle:
        bd_pairs.sum_copies(model, lambda chunk: [_grad_slot(p) for p in _trainable(chunk)])
        return
    if all(is_wrapped(c) for c in model):
        check_buffer_layouts(model)
    for copy_ in bd_pairs.stage_copies(pos):
        chunk = model[copy_.chunk]
        pair_sums.sum_now(sum_tensors(chunk), pos.group, in_place=is_wrapped(chunk),
                          what=f"global rank {pos.me}: bd sum of stage {copy_.stage} with global rank {pos.partner}",
                          timeout_s=BD_SUM_TIMEOUT_S)


def sum_tensors(chunk: torch.nn.Module) -> List[torch.Tensor]:
    """What a chunk's bd sum adds: DDP's grad buffers (in place), else the trainable parameters'
    gradient slots in ``parameters()`` order."""
    if is_wrapped(chunk):
        return [buf.grad_data for buf in _grad_buffers(chunk)]
    return [_grad_slot(p) for p in _trainable(chunk)]


def _grad_buffers(chunk) -> list:
    """Megatron DDP's contiguous gradient buffers of a chunk (dense, then expert-parallel)."""
    return list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))


_CHECKED_LAYOUTS: "weakref.WeakSet" = weakref.WeakSet()


def check_buffer_layouts(model) -> None:
    """Once per model, collective over the bd pair: both copies of each stage must have the same DDP
    buffer layout, or the in-place bd sums would add unrelated gradients."""
    if model[0] in _CHECKED_LAYOUTS:
        return
    for copy_ in bd_pairs.stage_copies():
        bd_pairs.check_same_structure(
            [(str(b.grad_dtype), b.grad_data.numel(), [bk.grad_data.numel() for bk in b.buckets])
             for b in _grad_buffers(model[copy_.chunk])],
            f"DDP gradient buffers of stage {copy_.stage} (the copies must be bucketed alike: wrap both chunks "
            f"with the same DistributedDataParallelConfig and disable_bucketing=True, as Megatron-LM's get_model "
            f"does under --pipeline-schedule dualpipe)")
    _CHECKED_LAYOUTS.add(model[0])


def _router_batch_statistics(chunk: torch.nn.Module) -> List[torch.Tensor]:
    """What the chunk's MoE routers gather over a global batch for Megatron's finalize to move them
    by, in module order: ``local_tokens_per_expert`` (expert bias), ``qb_beta_accum`` /
    ``qb_beta_count`` (quantile balancing, megatron-core 0.19)."""
    found = []
    for m in unwrap_chunk(chunk).modules():
        if getattr(m, "expert_bias", None) is not None and getattr(m, "local_tokens_per_expert", None) is not None:
            found.append(m.local_tokens_per_expert)
        if getattr(m, "qb_beta_accum", None) is not None and getattr(m, "qb_beta_count", None) is not None:
            found += [m.qb_beta_accum, m.qb_beta_count]
    return found


def allreduce_bd_router_statistics(model: Sequence[torch.nn.Module]) -> None:
    """DualPipe: sum the routers' global-batch statistics over the two copies of their stage before
    Megatron's finalize moves them: each copy saw one direction (unsummed, quantile balancing's lm
    loss was 2.7e-4 off at iteration 3). A no-op for DualPipeV."""
    if chunk_layout(model) == V_SHAPE or not any(_router_batch_statistics(c) for c in model):
        return
    bd_pairs.sum_copies(model, _router_batch_statistics)


def tied_copies(model: Sequence[torch.nn.Module]):
    """This rank's copies of the tied word embedding: (embedding weights, output weights), distinct
    parameters only."""
    emb, out = [], []
    for chunk in model:
        found = embedding_copy(chunk)
        if found is not None:
            (emb if found[0] == "embedding" else out).append(found[1])
    return emb, out


def fold_tied_embedding_grads(model: Sequence[torch.nn.Module]) -> None:
    """Tied embeddings or MTP: where a rank holds an embedding and a separate output-weight copy
    (DualPipe: ranks 0 and pp-1; DualPipeV: rank 0), set both gradients to their sum, the tied
    parameter's gradient after `allreduce_bd_grads`. Local."""
    emb, out = tied_copies(model)
    if not emb or not out:
        return
    if len(emb) != 1 or len(out) != 1:
        raise RuntimeError(f"unexpected tied-embedding copies on this rank: {len(emb)} embeddings, {len(out)} outputs")
    with torch.no_grad():
        ge, go = _grad_slot(emb[0]), _grad_slot(out[0])
        ge.add_(go)
        go.copy_(ge)


def finalize_dualpipe_grads(model: Sequence[torch.nn.Module], num_tokens: Optional[torch.Tensor], *,
                            finalize_func: Optional[Callable] = None, pg_collection=None,
                            force_all_reduce: Optional[bool] = False) -> Optional[torch.Tensor]:
    """DualPipe's ``finalize_model_grads_func`` for ``[model_dir0, model_dir1]``; returns the summed ``num_tokens``.
    ``finalize_func=None``: megatron-core's for DDP-wrapped chunks; plain chunks skip it (only without data,
    context or tensor parallelism, else ValueError)."""
    copies.of(model).sum_in_finalize(model, allreduce_bd_grads)
    fold_tied_embedding_grads(model)

    all_reduce_token_count(num_tokens, pg_collection)
    return finalize_after_token_count(model, num_tokens, finalize_func=finalize_func, pg_collection=pg_collection,
                                      force_all_reduce=force_all_reduce)


def all_reduce_token_count(num_tokens: Optional[torch.Tensor], pg_collection=None) -> None:
    """The program's ``coll token-count over pp`` op: each rank's count of the tokens whose loss it
    computed, summed over the pipeline group."""
    from megatron.core import parallel_state

    if isinstance(num_tokens, torch.Tensor):
        pp_group = pg_collection.pp if pg_collection is not None else parallel_state.get_pipeline_model_parallel_group()
        dist.all_reduce(num_tokens, group=pp_group)


def finalize_after_token_count(model: Sequence[torch.nn.Module], num_tokens: Optional[torch.Tensor], *,
                               finalize_func: Optional[Callable] = None, pg_collection=None,
                               force_all_reduce: Optional[bool] = False) -> Optional[torch.Tensor]:
    """The program's ``finalize`` op: Megatron's finalize, the chunks in the copy-sum way's order, its
    embedding all-reduces skipped (`NO_EMBEDDING_GROUP`; ``pos_embd`` None: the position embedding's
    two copies are a bd pair)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_model_config

    finalize_func = finalize_func if finalize_func is not None else _megatron_finalize(model, pg_collection)
    if finalize_func is None:
        return num_tokens
    config = get_model_config(model[0])
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    if getattr(config, "moe_router_enable_expert_bias", False) or "quantile_balancing" in (
            balancing if isinstance(balancing, (list, tuple)) else [balancing]):
        allreduce_bd_router_statistics(model)  # before Megatron's finalize moves the routers by their statistics
    pgc = copy.copy(pg_collection) if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
    pgc.embd = NO_EMBEDDING_GROUP
    pgc.pos_embd = None
    model = copies.of(model).finalize_order(model)
    finalize_func(model, num_tokens, pg_collection=pgc, force_all_reduce=force_all_reduce)
    return num_tokens


def _megatron_finalize(model, pg_collection) -> Optional[Callable]:
    """megatron-core's ``finalize_model_grads`` for DDP-wrapped chunks; None for plain chunks
    (allowed only without data/context or tensor parallelism)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_pg_size

    if all(is_wrapped(c) for c in model):
        from megatron.core.distributed import finalize_model_grads

        return finalize_model_grads
    if pg_collection is not None:
        dp_cp, tp = pg_collection.dp_cp, pg_collection.tp
    else:
        dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        tp = parallel_state.get_tensor_model_parallel_group()
    if get_pg_size(dp_cp) > 1 or get_pg_size(tp) > 1:
        raise ValueError("finalize_dualpipe_grads: the chunks are not wrapped in Megatron DDP, so megatron's "
                         "finalize_model_grads cannot run, but data/context or tensor parallelism needs it: wrap the "
                         "chunks (build_two_direction_model(wrap=...)) or pass finalize_func")
    return None


def is_wrapped(chunk: torch.nn.Module) -> bool:
    return hasattr(chunk, "finish_grad_sync")

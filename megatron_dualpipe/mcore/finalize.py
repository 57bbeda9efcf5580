"""Gradient finalize for the two model chunks of DualPipe / DualPipeV (after the schedule).

Each of DualPipe's two copies of a stage gets its own direction's gradient; the logical gradient is
their sum (`allreduce_bd_grads`, or during the schedule: ``grad_reduction.GradReduction``). Tied
embeddings are folded locally (`fold_tied_embedding_grads`) instead of by Megatron's embedding-group
all-reduce, which with two chunks picks the wrong one (``model[-1]`` on the last rank is a mirror).
"""
from __future__ import annotations

import copy
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


class _NoEmbeddingGroup:
    """``pg_collection.embd`` of size 1, so that megatron's finalize skips the word-embedding all-reduce
    (``embd=None`` makes megatron-core 0.16.1 fall back to ``parallel_state``'s embedding group)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "<no embedding group (DualPipe folds tied embeddings itself)>"


NO_EMBEDDING_GROUP = _NoEmbeddingGroup()


def chunk_layout(model: Sequence[torch.nn.Module]) -> str:
    info = chunk_info(model[0]) if len(model) else None
    return info["layout"] if info is not None else BIDIRECTIONAL


def _grad_slot(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor holding ``param``'s gradient: ``main_grad`` (Megatron DDP) when present, else
    ``param.grad``; a missing ``param.grad`` is replaced by zeros (and assigned)."""
    g = getattr(param, "main_grad", None)
    if g is not None:
        return g
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _trainable(chunk: torch.nn.Module) -> List[torch.nn.Parameter]:
    return [p for p in unwrap_chunk(chunk).parameters() if p.requires_grad]


def allreduce_bd_grads(model: Sequence[torch.nn.Module]) -> None:
    """Sum the two copies of each stage's gradients over the bd pair (DualPipe), now: both partners
    in stage order, through ``executor.pair_sums`` (`sum_tensors`); the middle rank of an odd pipeline
    locally. A no-op for DualPipeV. Run it before any data-parallel reduction has started."""
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
    """What a chunk's bd sum adds: Megatron DDP's grad buffers (in place), else every trainable
    parameter's gradient slot (``main_grad`` or ``.grad``) in ``parameters()`` order."""
    if is_wrapped(chunk):
        return [buf.grad_data for buf in _grad_buffers(chunk)]
    return [_grad_slot(p) for p in _trainable(chunk)]


def _grad_buffers(chunk) -> list:
    """Megatron DDP's contiguous gradient buffers of a chunk (dense, then expert-parallel)."""
    return list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))


_CHECKED_LAYOUTS: "weakref.WeakSet" = weakref.WeakSet()


def check_buffer_layouts(model) -> None:
    """Once per model: the two copies of each stage must have the same DDP buffer layout (dtype,
    size and bucket sizes of every buffer), or the in-place bd sums would add unrelated
    gradients. Collective over the bd pair (both partners call it before their first bd sum)."""
    if model[0] in _CHECKED_LAYOUTS:
        return

    def layout(chunk):
        return [(str(b.grad_dtype), b.grad_data.numel(), [bk.grad_data.numel() for bk in b.buckets])
                for b in _grad_buffers(chunk)]

    for copy_ in bd_pairs.stage_copies():
        bd_pairs.check_same_structure(
            layout(model[copy_.chunk]),
            f"DDP gradient buffers of stage {copy_.stage} (the copies must be bucketed alike: wrap both chunks "
            f"with the same DistributedDataParallelConfig and disable_bucketing=True, as Megatron-LM's get_model "
            f"does under --pipeline-schedule dualpipe)")
    _CHECKED_LAYOUTS.add(model[0])


def _router_batch_statistics(chunk: torch.nn.Module) -> List[torch.Tensor]:
    """What the chunk's MoE routers gather over a global batch for Megatron's finalize to move
    their bias by, in module order (the order Megatron stacks them): ``local_tokens_per_expert``
    of routers with an expert bias (``_update_router_expert_bias``), and ``qb_beta_accum`` /
    ``qb_beta_count`` of quantile-balancing routers (megatron-core 0.19, ``_update_router_qb_beta``)."""
    found = []
    for m in unwrap_chunk(chunk).modules():
        if getattr(m, "expert_bias", None) is not None and getattr(m, "local_tokens_per_expert", None) is not None:
            found.append(m.local_tokens_per_expert)
        if getattr(m, "qb_beta_accum", None) is not None and getattr(m, "qb_beta_count", None) is not None:
            found += [m.qb_beta_accum, m.qb_beta_count]
    return found


def allreduce_bd_router_statistics(model: Sequence[torch.nn.Module]) -> None:
    """DualPipe: sum each MoE router's global-batch statistics (expert-bias token counts, quantile
    balancing's sums) over the two copies of its stage before Megatron's finalize moves the router by
    them: each copy saw only its direction's micro-batches, and summed both make 1F1B's one update
    (unsummed, quantile balancing's lm loss was 2.7e-4 off at iteration 3). A no-op for DualPipeV."""
    if chunk_layout(model) == V_SHAPE or not any(_router_batch_statistics(c) for c in model):
        return
    bd_pairs.sum_copies(model, _router_batch_statistics)


def tied_copies(model: Sequence[torch.nn.Module]):
    """This rank's copies of the word embedding Megatron keeps equal (`embedding_copy`):
    (embedding weights, output weights), distinct parameters only (a chunk that is both first and
    last shares one parameter)."""
    emb, out = [], []
    for chunk in model:
        found = embedding_copy(chunk)
        if found is not None:
            (emb if found[0] == "embedding" else out).append(found[1])
    return emb, out


def fold_tied_embedding_grads(model: Sequence[torch.nn.Module]) -> None:
    """Tied embeddings or MTP: where a rank holds an embedding copy and a separate output-weight (or
    MTP embedding) copy (DualPipe: ranks 0 and pp-1; DualPipeV: rank 0), set both gradients to their
    sum: after `allreduce_bd_grads` that is the logical tied parameter's gradient. Local."""
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
                            force_all_reduce: Optional[bool] = False,
                            copies_summed: bool = False) -> Optional[torch.Tensor]:
    """Finalize gradients of ``[model_dir0, model_dir1]``: the DualPipe replacement of
    ``config.finalize_model_grads_func``. In order:

    1. the copy sum, as the way the copies are summed asks (``mcore.copies``: `allreduce_bd_grads`;
       none where Megatron's finalize sums them);
    2. `fold_tied_embedding_grads` (local); ``copies_summed=True`` skips 1-2 (``GradReduction`` did them);
    3. `all_reduce_token_count`: each rank counted the tokens whose loss it computed;
    4. `finalize_after_token_count`: Megatron's finalize without its embedding all-reduces (1-2 did
       that work), the chunks in the way's order.

    The bd sum runs before the data-parallel one; both are sums over disjoint rank sets, so the order
    does not change the result. ``finalize_func=None``: megatron-core's ``finalize_model_grads`` for
    chunks wrapped in Megatron DDP; for plain chunks step 4 is skipped (only without data, context or
    tensor parallelism, else ValueError; gradients are then not divided by ``num_tokens``). Returns the
    summed ``num_tokens`` (or None).
    """
    if not copies_summed:
        copies.of(model).sum_in_finalize(model, allreduce_bd_grads)  # as the way the copies are summed asks
        fold_tied_embedding_grads(model)

    all_reduce_token_count(num_tokens, pg_collection)
    return finalize_after_token_count(model, num_tokens, finalize_func=finalize_func, pg_collection=pg_collection,
                                      force_all_reduce=force_all_reduce)


def all_reduce_token_count(num_tokens: Optional[torch.Tensor], pg_collection=None) -> None:
    """Step 3 of `finalize_dualpipe_grads` (the program's ``coll token-count over pp`` op): every
    rank's count of the tokens whose loss it computed, summed over the pipeline group."""
    from megatron.core import parallel_state

    if isinstance(num_tokens, torch.Tensor):
        pp_group = pg_collection.pp if pg_collection is not None else parallel_state.get_pipeline_model_parallel_group()
        dist.all_reduce(num_tokens, group=pp_group)


def finalize_after_token_count(model: Sequence[torch.nn.Module], num_tokens: Optional[torch.Tensor], *,
                               finalize_func: Optional[Callable] = None, pg_collection=None,
                               force_all_reduce: Optional[bool] = False) -> Optional[torch.Tensor]:
    """Step 4 of `finalize_dualpipe_grads` (the program's ``finalize`` op): Megatron's finalize, the
    chunks in the copy-sum way's order, its embedding all-reduces skipped (`NO_EMBEDDING_GROUP`; the
    position embedding's two copies on stage 0 are a bd pair, so ``pos_embd`` is None)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_model_config

    finalize_func = finalize_func if finalize_func is not None else _megatron_finalize(model, pg_collection)
    if finalize_func is None:
        return num_tokens
    if _moves_router_bias(get_model_config(model[0])):
        allreduce_bd_router_statistics(model)  # before Megatron's finalize moves the routers' bias
    pgc = copy.copy(pg_collection) if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
    pgc.embd = NO_EMBEDDING_GROUP
    pgc.pos_embd = None
    model = copies.of(model).finalize_order(model)
    finalize_func(model, num_tokens, pg_collection=pgc, force_all_reduce=force_all_reduce)
    return num_tokens


def _megatron_finalize(model, pg_collection) -> Optional[Callable]:
    """megatron-core's ``finalize_model_grads`` for chunks wrapped in Megatron DDP; None for plain
    chunks, which it cannot finalize: allowed only without data/context or tensor parallelism."""
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


def _moves_router_bias(config) -> bool:
    """Whether Megatron's finalize updates the routers from their token counts (expert bias,
    quantile balancing): the two copies' counts must be summed first."""
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    return bool(getattr(config, "moe_router_enable_expert_bias", False)) or "quantile_balancing" in (
        balancing if isinstance(balancing, (list, tuple)) else [balancing])


def is_wrapped(chunk: torch.nn.Module) -> bool:
    return hasattr(chunk, "finish_grad_sync")

"""Gradient finalize for the two model chunks of DualPipe / DualPipeV.

DualPipe keeps every stage twice (``model[0]`` on its home rank i, ``model[1]`` on rank
pp-1-i), and each copy receives the gradient of the micro-batches of its own direction. The
logical gradient is their sum: `allreduce_bd_grads`. With tied word embeddings the embedding
(stage 0) and the output weight (stage pp-1, or 2pp-1 for DualPipeV) are one logical
parameter; after the bd sum every rank that holds both an embedding copy and an output copy
(ranks 0 and pp-1 for DualPipe, rank 0 for DualPipeV) sets both to their sum:
`fold_tied_embedding_grads`. That replaces megatron's embedding-group all-reduce, which with
two chunks picks the wrong chunk (``model[-1]`` on the last pipeline rank is the mirrored
stage-0 copy, not the output layer) and is therefore switched off in `finalize_dualpipe_grads`.
"""
from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..schedule import grad_order
from . import bd_pairs
from .model import BIDIRECTIONAL, V_SHAPE, chunk_info, unwrap_chunk

__all__ = ["GradReduction", "allreduce_bd_grads", "allreduce_bd_router_token_counts", "fold_tied_embedding_grads",
           "finalize_dualpipe_grads"]


class _NoEmbeddingGroup:
    """Stands in for ``pg_collection.embd`` so that megatron's finalize skips the word-embedding
    all-reduce: ``get_pg_size`` of it is 1.

    ``embd=None`` does not work in megatron-core 0.16.1: ``_allreduce_word_embedding_grads``
    then falls back to ``parallel_state.get_embedding_group()`` and, on the ranks of a 2-rank
    embedding group, asserts ``pp_group is None``. Never used for communication.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "<no embedding group (DualPipe folds tied embeddings itself)>"


NO_EMBEDDING_GROUP = _NoEmbeddingGroup()


def _layout(model: Sequence[torch.nn.Module]) -> str:
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
    """Sum the gradients of the two copies of each stage over the bd pair (DualPipe).

    On pipeline rank i the pair holds stages i (``model[0]`` here, ``model[1]`` on the partner)
    and pp-1-i. Both partners reduce the two stages in stage order, min(i, pp-1-i) first, each
    as one all-reduce(SUM) per dtype over the flattened gradients of the chunk's trainable
    parameters in ``parameters()`` order (identical on both copies). Uses ``param.main_grad``
    when present (Megatron DDP buffers) and ``param.grad`` otherwise; a parameter without a
    gradient contributes zeros and gets a zero ``.grad`` assigned, so both partners always
    reduce equal sizes. On the middle rank of an odd pipeline the two copies are summed
    locally. A no-op for DualPipeV (its chunks are different stages).

    Synchronous; run it before any data-parallel reduction of the chunks has started. The
    executor's schedules use `GradReduction` instead, which starts the same sums chunk by chunk
    while the schedule runs.
    """
    if _layout(model) == V_SHAPE:
        return
    if len(model) != 2:
        raise ValueError(f"allreduce_bd_grads needs [model_dir0, model_dir1], got {len(model)} chunks")
    bd_pairs.sum_copies(model, lambda chunk: [_grad_slot(p) for p in _trainable(chunk)])


def _router_token_counts(chunk: torch.nn.Module) -> List[torch.Tensor]:
    """The ``local_tokens_per_expert`` counters of the chunk's MoE routers with an expert bias,
    in module order (the order Megatron's ``_update_router_expert_bias`` stacks them)."""
    return [m.local_tokens_per_expert for m in unwrap_chunk(chunk).modules()
            if getattr(m, "expert_bias", None) is not None and getattr(m, "local_tokens_per_expert", None) is not None]


def allreduce_bd_router_token_counts(model: Sequence[torch.nn.Module]) -> None:
    """``--moe-router-enable-expert-bias`` (aux-loss-free balancing), DualPipe: sum each MoE
    router's token counts over the two copies of its stage.

    Each copy counts the tokens of its own direction's micro-batches; Megatron's finalize then
    moves ``expert_bias`` by the sign of (mean count - count), all-reduced over TP x CP x DP. With
    the counts summed first, both copies see the whole global batch, as 1F1B's one copy does,
    and make the same update, so they keep routing alike. A no-op for DualPipeV and without
    expert-bias routers.
    """
    if _layout(model) == V_SHAPE or not any(_router_token_counts(c) for c in model):
        return
    bd_pairs.sum_copies(model, _router_token_counts)


def _tied_copies(model: Sequence[torch.nn.Module]):
    """This rank's copies of the tied word embedding: (embedding weights, output weights),
    distinct parameters only (a chunk that is both first and last shares one parameter)."""
    emb, out = [], []
    for chunk in model:
        m = unwrap_chunk(chunk)
        if not getattr(m, "share_embeddings_and_output_weights", False):
            continue
        if getattr(m, "pre_process", False):
            emb.append(m.embedding.word_embeddings.weight)
        if getattr(m, "post_process", False) and not getattr(m, "pre_process", False):
            w = m.output_layer.weight
            if w is not None:
                out.append(w)
    return emb, out


def fold_tied_embedding_grads(model: Sequence[torch.nn.Module]) -> None:
    """Tied embeddings: where a rank holds an embedding copy and a separate output-weight copy
    (DualPipe: ranks 0 and pp-1; DualPipeV: rank 0), set both gradients to their sum.

    Run it after `allreduce_bd_grads` (then the embedding copy already holds both directions'
    embedding gradient and the output copy both directions' output gradient, so the sum is the
    gradient of the logical tied parameter on both ranks). Local, no communication. Does
    nothing for untied models or ranks without both copies.
    """
    emb, out = _tied_copies(model)
    if not emb or not out:
        return
    if len(emb) != 1 or len(out) != 1:
        raise RuntimeError(
            f"unexpected tied-embedding copies on this rank: {len(emb)} embeddings, {len(out)} outputs"
        )
    with torch.no_grad():
        ge, go = _grad_slot(emb[0]), _grad_slot(out[0])
        ge.add_(go)
        go.copy_(ge)


def _is_wrapped(chunk: torch.nn.Module) -> bool:
    return hasattr(chunk, "finish_grad_sync")


def finalize_dualpipe_grads(
    model: Sequence[torch.nn.Module],
    num_tokens: Optional[torch.Tensor],
    *,
    finalize_func: Optional[Callable] = None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
    copies_summed: bool = False,
) -> Optional[torch.Tensor]:
    """Finalize gradients of ``[model_dir0, model_dir1]``: the DualPipe replacement of
    ``config.finalize_model_grads_func``. In order:

    1. `allreduce_bd_grads` (bd pairs; skipped for DualPipeV);
    2. `fold_tied_embedding_grads` (local);
    3. if ``num_tokens`` is a tensor: all-reduce(SUM) over the pipeline group
       (``pg_collection.pp`` or parallel_state's). Each rank passes the tokens of the
       micro-batches whose loss it computed (its last stages: rank pp-1 for direction 0 and
       rank 0 for direction 1 in DualPipe, rank 0 in DualPipeV, zero elsewhere), so every rank
       gets the total. Megatron's finalize then broadcasts it from the last pipeline rank (same
       value) and all-reduces it over data parallel;
    4. ``finalize_func(model, num_tokens, pg_collection=pgc, force_all_reduce=...)`` with ``pgc``
       a copy of ``pg_collection`` (default: the ``parallel_state`` groups) whose ``embd`` is a
       size-1 placeholder (`NO_EMBEDDING_GROUP`; ``None`` would make megatron fall back to
       ``parallel_state``'s embedding group) and whose ``pos_embd`` is None, so megatron's word-
       and position-embedding all-reduces are skipped (steps 1-2 did that work; the position
       embedding lives on stage 0, whose two copies are a bd pair).

    ``copies_summed=True`` skips steps 1-2 (a `GradReduction` did them during the schedule).

    Collective order on every rank: bd all-reduce(s) [bd group], tokens all-reduce [pp group],
    then megatron's: ``finish_grad_sync`` per chunk (DP all-reduce / reduce-scatter), TP
    reductions of sequence-parallel / qk-layernorm grads, token broadcast [pp] and all-reduce
    [DP]. The bd reduction therefore runs before the data-parallel one; both are sums over
    disjoint rank sets, so the order does not change the result.

    ``finalize_func=None`` means megatron-core's ``finalize_model_grads`` when the chunks are
    wrapped (Megatron DDP: they have ``finish_grad_sync``). For unwrapped chunks (plain
    ``GPTModel``, as in tests) megatron's finalize cannot run (it calls
    ``model_chunk.finish_grad_sync()``, and ``scale_gradients`` for per-token loss), so step 4
    is skipped; that is only allowed without data/context parallelism and with tp == 1
    (else ValueError), and gradients are then *not* divided by ``num_tokens``. Returns the
    summed ``num_tokens`` (or None).
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_model_config, get_pg_size

    if not copies_summed:
        allreduce_bd_grads(model)
        fold_tied_embedding_grads(model)

    pp_group = pg_collection.pp if pg_collection is not None else parallel_state.get_pipeline_model_parallel_group()
    if isinstance(num_tokens, torch.Tensor):
        dist.all_reduce(num_tokens, group=pp_group)

    if finalize_func is None:
        if all(_is_wrapped(c) for c in model):
            from megatron.core.distributed import finalize_model_grads as finalize_func
        else:
            if pg_collection is not None:
                dp_cp, tp = pg_collection.dp_cp, pg_collection.tp
            else:
                dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
                tp = parallel_state.get_tensor_model_parallel_group()
            if get_pg_size(dp_cp) > 1 or get_pg_size(tp) > 1:
                raise ValueError(
                    "finalize_dualpipe_grads: the chunks are not wrapped in Megatron DDP, so "
                    "megatron's finalize_model_grads cannot run, but data/context or tensor "
                    "parallelism needs it: wrap the chunks (build_two_direction_model(wrap=...)) "
                    "or pass finalize_func"
                )
            return num_tokens

    if getattr(get_model_config(model[0]), "moe_router_enable_expert_bias", False):
        allreduce_bd_router_token_counts(model)  # before Megatron's finalize moves expert_bias
    pgc = copy.copy(pg_collection) if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
    pgc.embd = NO_EMBEDDING_GROUP
    pgc.pos_embd = None
    finalize_func(model, num_tokens, pg_collection=pgc, force_all_reduce=force_all_reduce)
    return num_tokens


# ------------------------------------------------------------------------------------------
# The reduction of one iteration, started chunk by chunk while the schedule runs
# ------------------------------------------------------------------------------------------


class GradReduction:
    """One iteration's gradient reduction for an executor schedule, started per chunk as soon as
    the chunk's gradients are final on this rank, while the rest of the schedule runs.

    The stage compute tells it every backward / weight-gradient action it ran (`after_action`);
    after the chunk's last one (its last real ``W``, or ``B``/``BW`` without deferred weight
    gradients):

    1. ``--defer-embedding-wgrad-compute``: Megatron's deferred output-layer weight gradients of the
       chunk are computed (``schedules.finish_embedding_wgrad_compute``), as 1F1B does at its end;
    2. DualPipe: the chunk is summed with its partner's copy of the stage over the bd pair: one
       asynchronous all-reduce per Megatron DDP grad buffer, in place (no copy of the gradients;
       both copies have the same buffer layout, checked once per model before the first
       schedule), or of the flattened ``param.grad`` for chunks without DDP. Both partners issue
       the pair's two sums in the same order: the order in which their chunks finish when the
       schedule makes it the same on both ranks (DualPipe's symmetry), else the lower rank's
       order, holding a finished chunk back until the one before it is done;
    3. once its sum is in, the chunk's data-parallel reduction starts (``config.grad_sync_func``,
       Megatron DDP's ``start_grad_sync`` under ``--overlap-grad-reduce``), in the order the chunks
       finished (the same on every data-parallel peer, so their collectives pair up). On an
       accelerator the sum is waited at once (a stream-ordered wait: the host does not block);
       on the CPU it is picked up when seen complete. A chunk holding a tied-embedding copy on a
       rank that holds both copies waits for `finish`, where the fold (with a finalize function,
       whose embedding all-reduce it replaces) needs both sums.

    `finish` (after the schedule) completes the rest: every sum waited, tied embeddings folded,
    the remaining data-parallel reductions started. Megatron's finalize then waits for them as
    after its own 1F1B (``finish_grad_sync``); see ``finalize_dualpipe_grads(copies_summed=True)``.

    While the schedule runs (`during_schedule`), Megatron DDP's backward hooks only accumulate
    into ``main_grad``: they dispatch nothing (the schedule holds ``no_sync``), and
    ``overlap_grad_reduce`` is off in the DDP config so that a backward whose weight gradient is
    deferred (zero bubble) does not trip DDP's ``param.grad is not None`` assertion.
    """

    def __init__(self, model: Sequence[torch.nn.Module], config, *, actions, partner_actions,
                 is_fake: Callable, deferring: bool):
        from .bd_pairs import position

        self.model, self.config = list(model), config
        ops = grad_order.grad_ops(deferring)
        self._last = grad_order.last_grad_actions(actions, is_fake, ops)
        n = len(self.model)
        bidirectional = _layout(self.model) == BIDIRECTIONAL and n == 2
        self._pos = position() if bidirectional else None
        self._local_sum = bidirectional and self._pos.is_middle  # odd pipeline: both copies here
        self._bd = bidirectional and not self._local_sum
        self._order = grad_order.bd_sum_order(actions, partner_actions, is_fake, ops,
                                              lower_rank=self._pos.index < self._pos.pp - 1 - self._pos.index) \
            if self._bd else list(range(n))
        if self._bd and all(_is_wrapped(c) for c in self.model):
            _check_buffer_layouts(self.model)
        self._dp_start = _dp_start_functions(config, self.model)
        # The fold replaces Megatron's embedding-group all-reduce, a step of its finalize: without a
        # finalize function neither happens (as with megatron-core's own 1F1B).
        emb, out = _tied_copies(self.model)
        fold = bool(emb) and bool(out) and config.finalize_model_grads_func is not None
        self._fold = fold
        self._held = {c for c in range(n) if self._local_sum or (fold and _holds_tied_copy(self.model[c]))}
        self._ddp_configs: dict = {}  # set while the schedule runs (during_schedule)
        self._configured: dict = {}
        self._done: List[int] = []  # chunks whose gradients are final, in that order
        self._issued: List[int] = []  # chunks whose bd sums were issued
        self._pending: List[tuple] = []  # (chunk, handles, copy-back) of bd sums not seen complete
        self._summed: set = set()
        self._dp_started: set = set()
        for chunk in self.model:
            _clear_deferred_output_wgrads(config, chunk)

    # -- during the schedule ---------------------------------------------------------------------
    @contextlib.contextmanager
    def during_schedule(self):
        self._ddp_configs = {id(c.ddp_config): c.ddp_config for c in self.model
                             if getattr(c, "ddp_config", None) is not None}
        self._configured = {k: cfg.overlap_grad_reduce for k, cfg in self._ddp_configs.items()}
        for cfg in self._ddp_configs.values():
            cfg.overlap_grad_reduce = False
        try:
            yield
        finally:
            self._set_overlap(self._configured)
            self._ddp_configs = {}

    def _set_overlap(self, values: dict) -> None:
        for k, cfg in self._ddp_configs.items():
            cfg.overlap_grad_reduce = values[k]

    @contextlib.contextmanager
    def _as_configured(self):
        """Megatron's ``start_grad_sync`` as the user configured it (during the schedule the flag is
        off): asynchronous under ``--overlap-grad-reduce``, leaving the handle that its
        ``finish_grad_sync`` waits for. Synchronous, it left no handle, and ``finish_grad_sync``
        (still in its first-batch mode: the hooks never register a gradient) reduced the bucket a
        second time: harmless for an averaging all-reduce, wrong for the distributed optimizer's
        reduce-scatter."""
        during = dict(self._configured) if self._ddp_configs else None
        if during is not None:
            self._set_overlap(during)
        try:
            yield
        finally:
            if during is not None:
                self._set_overlap({k: False for k in during})

    def after_action(self, a) -> None:
        """Called by the stage compute after each backward / weight-gradient action it ran."""
        if self._last.get(a.dir) == (a.op, a.mb, a.stage):
            self._chunk_done(a.dir)

    def _chunk_done(self, c: int) -> None:
        if c in self._done:
            return
        self._done.append(c)
        _finish_deferred_output_wgrads(self.config, self.model[c])
        if not self._bd:
            self._summed.add(c)
        for nxt in self._order if self._bd else ():
            if nxt in self._issued:
                continue
            if nxt not in self._done:
                break
            self._issue_sum(nxt)
        self._collect(block=False)

    def _issue_sum(self, c: int) -> None:
        self._issued.append(c)
        chunk, group = self.model[c], self._pos.group
        if _is_wrapped(chunk):
            handles = [dist.all_reduce(buf.grad_data, group=group, async_op=True) for buf in _grad_buffers(chunk)]
            self._pending.append((c, handles, None))
        else:
            from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

            grads = [_grad_slot(p) for p in _trainable(chunk)]
            for idx in bd_pairs.dtype_groups(grads).values():
                tensors = [grads[k] for k in idx]
                flat = _flatten_dense_tensors(tensors)
                handle = dist.all_reduce(flat, group=group, async_op=True)

                def copy_back(flat=flat, tensors=tensors):
                    for t, summed in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                        t.copy_(summed)
                self._pending.append((c, [handle], copy_back))
        if not any(e[0] == c for e in self._pending):
            self._pending.append((c, [], None))  # nothing to sum
        if _on_accelerator(chunk):
            self._collect(block=True)  # waits only order the streams

    def _collect(self, block: bool) -> None:
        """Take in the bd sums that are complete (all with ``block``), then start the
        data-parallel reductions that may start, in the order the chunks finished."""
        still, finished = [], []
        for entry in self._pending:
            c, handles, copy_back = entry
            if block or all(h.is_completed() for h in handles):
                for h in handles:
                    h.wait()
                if copy_back is not None:
                    with torch.no_grad():
                        copy_back()
                finished.append(c)
            else:
                still.append(entry)
        self._pending = still
        self._summed.update(c for c in finished if not any(e[0] == c for e in still))
        for c in self._done:
            if c in self._dp_started or c in self._held:
                continue
            if c not in self._summed:
                break
            self._start_dp(c)

    def _start_dp(self, c: int) -> None:
        self._dp_started.add(c)
        if self._dp_start[c] is not None:
            with self._as_configured():
                self._dp_start[c](self.model[c].parameters())

    # -- after the schedule -------------------------------------------------------------------------
    def finish(self) -> None:
        """Complete the reduction: every chunk done, every sum waited, tied embeddings folded, every
        data-parallel reduction started."""
        for c in range(len(self.model)):
            self._chunk_done(c)
        self._collect(block=True)
        if self._local_sum:
            allreduce_bd_grads(self.model)  # the middle rank of an odd pipeline sums locally
        if self._fold:
            fold_tied_embedding_grads(self.model)
        self._held = set()
        self._collect(block=True)


def _dp_start_functions(config, model) -> list:
    """Per chunk: what starts its data-parallel reduction early (``config.grad_sync_func``,
    which Megatron-LM sets with --overlap-grad-reduce), or None (reduced in finalize)."""
    funcs = config.grad_sync_func
    if funcs is None:
        return [None] * len(model)
    funcs = funcs if isinstance(funcs, list) else [funcs]
    return funcs * len(model) if len(funcs) == 1 else list(funcs)


def _holds_tied_copy(chunk) -> bool:
    m = unwrap_chunk(chunk)
    return bool(getattr(m, "share_embeddings_and_output_weights", False)) and \
        bool(getattr(m, "pre_process", False) or getattr(m, "post_process", False))


def _grad_buffers(chunk) -> list:
    """Megatron DDP's contiguous gradient buffers of a chunk (dense, then expert-parallel)."""
    return list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))


def _on_accelerator(chunk) -> bool:
    p = next(iter(unwrap_chunk(chunk).parameters()), None)
    return p is not None and p.device.type != "cpu"


_CHECKED_LAYOUTS: "weakref.WeakSet" = weakref.WeakSet()


def _check_buffer_layouts(model) -> None:
    """Once per model: the two copies of each stage must have the same DDP buffer layout (dtype,
    size and bucket sizes of every buffer), or the in-place bd sums would add unrelated
    gradients. Collective over the bd pair (both partners reach it at their first bd sum)."""
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


def _output_layer_module(config, chunk):
    """The GPT module whose output layer defers its weight gradients, or None."""
    if not getattr(config, "defer_embedding_wgrad_compute", False):
        return None
    m = unwrap_chunk(chunk)
    return m if getattr(m, "post_process", False) and getattr(m, "embedding_activation_buffer", None) is not None \
        else None


def _clear_deferred_output_wgrads(config, chunk) -> None:
    """``--defer-embedding-wgrad-compute``: no stray activations from an earlier (evaluation) run."""
    m = _output_layer_module(config, chunk)
    if m is not None:
        m.embedding_activation_buffer.clear()
        m.grad_output_buffer.clear()


def _finish_deferred_output_wgrads(config, chunk) -> None:
    """``--defer-embedding-wgrad-compute``: the output layer's weight gradients, deferred by its
    backward to the end of the chunk's micro-batches (Megatron's own drain, as its 1F1B calls)."""
    m = _output_layer_module(config, chunk)
    if m is not None:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import schedules

        schedules.finish_embedding_wgrad_compute(config, m, True, parallel_state.get_tensor_model_parallel_group())

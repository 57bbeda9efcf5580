"""One iteration's gradient reduction, started chunk by chunk where the rank's program says.

The runner hands a `GradReduction` every ``final`` / ``sum`` / ``summed`` / ``dp`` op of the
rank's program (`GradReduction.on_reduction`: the ops the lowering put into the list and the
iteration plan checked, ``schedule.lowering``; ``final C``: chunk C's gradient actions are done);
the ops after the schedule reach it the same way, in list order
(``mcore.program_ops``), between `GradReduction.end_schedule` and `GradReduction.complete`. Every
collective it issues is at a place of that program, the same on every rank that shares the
communicator; it decides none itself, and nothing depends on when a sum happens to complete.

Per chunk (one `_Chunk` state each):

1. at its ``final`` op, ``--defer-embedding-wgrad-compute``: Megatron's
   deferred output-layer weight gradients of the chunk are computed
   (``schedules.finish_embedding_wgrad_compute``), as 1F1B does at its end;
2. DualPipe: its bd sum (the two copies of the stage summed over the bd pair, in place over
   Megatron DDP's grad buffers) is issued at the point the iteration plan gives
   (``lowering.reductions.bd_sum_points``: both partners in the same order of stages) through
   ``executor.pair_sums``, and waited by the program's ``summed`` ops after the schedule: a wait
   on an accelerator makes the compute stream wait, and the partner may first need a tensor
   queued behind it (issue 17);
3. its data-parallel reduction (``config.grad_sync_func``, Megatron DDP's ``start_grad_sync``
   under ``--overlap-grad-reduce``) starts at the plan's point (``lowering.reductions.dp_start_points``,
   the program's ``dp`` op): right after its last gradient action where nothing changes its
   gradients later, else after the schedule. A poll once started it when the bd sum was
   seen complete: a point that differed between the data-parallel replicas, whose collectives
   on one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) can then wait for each other.

With ``--dualpipe-shared-shard-group`` there is no bd sum: each chunk's reduce-scatter runs over
both copies' ranks (``mcore.shard_groups``) in Megatron's finalize, in stage order
(``finalize.finalize_dualpipe_grads``); the tied-embedding fold adds this rank's two unsummed
copies, and the reduce-scatter's sum over both ranks' folds is the tied gradient. With
``--dualpipe-dp-first`` neither: the pair sums the chunk's shards right after its reduce-scatter
(``mcore.copies.dp_first``, in Megatron's finalize, stage order), the fold as with the shared group.

After the schedule the program waits for every sum (``summed``: the plan proves it safe there);
at its ``settle`` op tied embeddings are folded (and the middle rank of an odd pipeline sums its
two copies locally); then the reductions the program puts there start, in its order. Megatron's finalize waits for them as after its own 1F1B (``finish_grad_sync``;
``finalize.finalize_dualpipe_grads(copies_summed=True)``).

While the schedule runs (`GradReduction.during_schedule`), Megatron DDP's backward hooks only
accumulate into ``main_grad`` (the schedule holds ``no_sync``), and ``overlap_grad_reduce`` is off
in the DDP config so that a backward whose weight gradient is deferred (zero bubble) does not
trip DDP's ``param.grad is not None`` assertion.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..executor import pair_sums
from ..schedule.lowering import OpKind
from . import bd_pairs, copies
from .finalize import (BD_SUM_TIMEOUT_S, is_wrapped, chunk_layout, tied_copies, allreduce_bd_grads,
                       check_buffer_layouts, fold_tied_embedding_grads, sum_tensors)
from .model import BIDIRECTIONAL, embedding_copy, unwrap_chunk
from .dp_watch import watch_dp_reduction

__all__ = ["GradReduction", "clear_deferred_output_wgrads"]


@dataclass
class _Chunk:
    """One model chunk's progress through the iteration's reduction."""

    index: int
    dp_start: Optional[Callable]  # what starts its data-parallel reduction, or None (finalize does)
    final_at_finish: bool         # its gradients change in finish (bd sum, local sum, tied fold)
    done: bool = False            # its last gradient action ran
    dp_started: bool = False


class GradReduction:
    """See the module docstring."""

    def __init__(self, model: Sequence[torch.nn.Module], config):
        self.model, self.config = list(model), config
        n = len(self.model)
        bidirectional = chunk_layout(self.model) == BIDIRECTIONAL and n == 2
        self._pos = bd_pairs.position() if bidirectional else None
        self._local_sum = bidirectional and self._pos.is_middle  # odd pipeline: both copies here
        paired = bidirectional and not self._local_sum
        # the way the copies are summed (mcore.copies): by the bd sum during the schedule, or
        # in Megatron's finalize (over the shard groups, or on the shards after the reduce-scatter)
        bd = paired and copies.of(self.model).way.sums_in_schedule
        if paired and all(is_wrapped(c) for c in self.model):
            check_buffer_layouts(self.model)
        # The fold replaces Megatron's embedding-group all-reduce, a step of its finalize: without a
        # finalize function neither happens (as with megatron-core's own 1F1B).
        emb, out = tied_copies(self.model)
        self._fold = bool(emb) and bool(out) and config.finalize_model_grads_func is not None
        starts = _dp_start_functions(config, self.model)
        self.chunks = [_Chunk(c, starts[c], bd or self._local_sum or (self._fold and _holds_tied_copy(self.model[c])))
                       for c in range(n)]
        self._ended = self._settled = False
        self._sums = None
        if bd:
            pos = self._pos
            self._sums = pair_sums.PairSums(  # issued and waited by the program's sum / summed ops
                {}, lambda c: sum_tensors(self.model[c]), pos.group,
                in_place=lambda c: is_wrapped(self.model[c]), timeout_s=BD_SUM_TIMEOUT_S,
                describe=lambda c: (f"global rank {pos.me}: the bd sum of stage {self._stage_of(c)} "
                                    f"with global rank {pos.partner}"))
        self._ddp_configs: dict = {}  # set while the schedule runs (during_schedule)
        self._configured: dict = {}
        clear_deferred_output_wgrads(config, self.model)

    def _stage_of(self, c: int) -> int:
        """DualPipe's stage of chunk ``c`` on this rank: its own (0) or the mirrored one (1)."""
        return self._pos.index if c == 0 else self._pos.pp - 1 - self._pos.index

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

    def on_reduction(self, kind: OpKind, c: int) -> None:
        """A ``final`` / ``sum`` / ``summed`` / ``dp`` op of the rank's program, where the lowering put
        it: chunk ``c``'s gradient actions are done, issue its bd sum, wait for it, or start its
        data-parallel reduction."""
        if kind == OpKind.FINAL:
            self._chunk_done(c)
            return
        if kind == OpKind.SETTLE:
            self._settle()
            return
        if kind == OpKind.DP:
            self._start_dp(c)
            return
        if kind not in (OpKind.SUM, OpKind.SUMMED):
            raise ValueError(f"not a reduction op: {kind!r}")
        if self._sums is None:
            raise RuntimeError(f"megatron-dualpipe: the iteration plan sums chunk {c}'s copies, which this "
                               f"rank sums no other way than in its finalize (a bug)")
        (self._sums.issue if kind == OpKind.SUM else self._sums.wait)(c)

    def _chunk_done(self, c: int) -> None:
        state = self.chunks[c]
        if state.done:
            return
        state.done = True
        _finish_deferred_output_wgrads(self.config, self.model[c])

    def _start_dp(self, c: int) -> None:
        """Start chunk ``c``'s data-parallel reduction where the program puts it (the same place on
        every replica). A program that starts it before its gradients are final is a bug: raise,
        never reduce a partial gradient."""
        state = self.chunks[c]
        if state.dp_started or not (state.done and (self._settled or not state.final_at_finish)):
            raise RuntimeError(f"megatron-dualpipe: the iteration plan starts the data-parallel reduction of chunk {c} "
                               f"{'twice' if state.dp_started else 'before its gradients are final'} (a bug)")
        state.dp_started = True
        if state.dp_start is not None:
            with self._as_configured():
                state.dp_start(self.model[c].parameters())
            watch_dp_reduction(self.model[c], f"global rank {dist.get_rank()}, chunk {c}")

    # -- after the schedule -------------------------------------------------------------------------
    def end_schedule(self) -> None:
        """The schedule ran; the program's ops after it follow."""
        self._ended = True

    def _settle(self) -> None:
        """The program's ``settle`` op, after every sum is waited: the middle rank's local sum and the
        tied-embedding fold, which change gradients that the reductions started after them reduce."""
        if self._settled or not self._ended or (self._sums is not None and self._sums.pending):
            when = "twice" if self._settled else "before the schedule ends and every bd sum is waited"
            raise RuntimeError(f"megatron-dualpipe: the program settles {when} (a bug)")
        self._settled = True
        if self._local_sum:
            allreduce_bd_grads(self.model)  # the middle rank of an odd pipeline sums locally
        if self._fold:
            fold_tied_embedding_grads(self.model)

    def complete(self) -> None:
        """The program's ops ran: every sum waited, the fold done, every reduction started."""
        missed = [s.index for s in self.chunks if not s.dp_started]
        if missed:
            raise RuntimeError(f"megatron-dualpipe: the iteration plan starts no data-parallel reduction of "
                               f"chunk(s) {missed} (a bug)")


def _dp_start_functions(config, model) -> list:
    """Per chunk: what starts its data-parallel reduction early (``config.grad_sync_func``,
    which Megatron-LM sets with --overlap-grad-reduce), or None (reduced in finalize).

    None too in an iteration whose gradients Megatron-LM saves (``--save-wgrads-interval``): it
    sets the chunks' ``force_all_reduce``, which DDP's own backward hooks pass on, but
    ``start_grad_sync`` does not take it and would reduce-scatter; finalize's
    ``finish_grad_sync(force_all_reduce=True)`` then all-reduces what it starts itself."""
    funcs = config.grad_sync_func
    if funcs is None:
        return [None] * len(model)
    funcs = funcs if isinstance(funcs, list) else [funcs]
    funcs = funcs * len(model) if len(funcs) == 1 else list(funcs)
    return [None if getattr(chunk, "force_all_reduce", False) else f for f, chunk in zip(funcs, model)]


def _holds_tied_copy(chunk) -> bool:
    return embedding_copy(chunk) is not None


def _output_layer_module(config, chunk):
    """The GPT module whose output layer defers its weight gradients, or None."""
    if not getattr(config, "defer_embedding_wgrad_compute", False):
        return None
    m = unwrap_chunk(chunk)
    return m if getattr(m, "post_process", False) and getattr(m, "embedding_activation_buffer", None) is not None \
        else None


def clear_deferred_output_wgrads(config, model) -> None:
    """``--defer-embedding-wgrad-compute``: empty the output layer's buffers of deferred activations
    and output gradients. Before a training run (no stray activations of an earlier evaluation),
    and after every evaluation run: its forwards append their activations too, and nothing
    drains them, so they would grow through the evaluation."""
    for chunk in model:
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

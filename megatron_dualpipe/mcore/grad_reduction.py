"""One iteration's gradient reduction, issued op by op where the rank's program puts it.

The runner hands it every ``final`` / ``sum`` / ``summed`` / ``settle`` / ``dp`` op (through
``mcore.program_ops``); the lowering placed them and the iteration plan checked them, so every collective is
at a point of the program, the same on every rank of its communicator. ``final C`` drains Megatron's deferred
output-layer weight gradients as 1F1B does at its end; ``sum C`` / ``summed C`` are the bd sum of DualPipe's
two copies over DDP's grad buffers, waited after the schedule (a wait on an accelerator makes the compute
stream wait while the partner may need a tensor queued behind it, issue 17); ``settle`` is the middle rank's
local sum and the tied fold; ``dp C`` is ``config.grad_sync_func``. With ``--dualpipe-shared-shard-group`` or
``--dualpipe-dp-first`` the copies are summed in Megatron's finalize (``mcore.copies``). While the schedule
runs, DDP's hooks only accumulate and ``overlap_grad_reduce`` is off: a deferred weight gradient would trip
DDP's ``param.grad is not None`` assertion.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..executor import pair_sums, watchdog
from ..executor.streams import waits_order_stream
from ..schedule.lowering import OpKind
from . import bd_pairs, copies
from .finalize import (BD_SUM_TIMEOUT_S, is_wrapped, chunk_layout, tied_copies, allreduce_bd_grads,
                       check_buffer_layouts, fold_tied_embedding_grads, sum_tensors)
from .model import BIDIRECTIONAL, embedding_copy, unwrap_chunk

__all__ = ["GradReduction", "clear_deferred_output_wgrads"]


class GradReduction:
    """See the module docstring."""

    def __init__(self, model: Sequence[torch.nn.Module], config):
        self.model, self.config = list(model), config
        bidirectional = chunk_layout(self.model) == BIDIRECTIONAL and len(self.model) == 2
        self._pos = bd_pairs.position() if bidirectional else None
        self._local_sum = bidirectional and self._pos.is_middle  # odd pipeline: both copies here
        paired = bidirectional and not self._local_sum
        if paired and all(is_wrapped(c) for c in self.model):
            check_buffer_layouts(self.model)
        # The fold replaces Megatron's embedding-group all-reduce, a step of its finalize: without a
        # finalize function neither happens (as with megatron-core's own 1F1B).
        emb, out = tied_copies(self.model)
        self._fold = bool(emb) and bool(out) and config.finalize_model_grads_func is not None
        self._dp_start = _dp_start_functions(config, self.model)
        self._done: set = set()        # chunks whose gradient actions ran (their ``final`` op)
        self._dp_started: set = set()
        self._settled = False
        self._sums = None
        bd = paired and copies.of(self.model).way.sums_in_schedule
        # the chunks whose gradients change at ``settle`` (the bd sums, the local sum, the tied fold)
        self._settled_later = {c for c, chunk in enumerate(self.model)
                               if bd or self._local_sum or (self._fold and embedding_copy(chunk) is not None)}
        if bd:
            pos = self._pos
            stage = {copy_.chunk: copy_.stage for copy_ in bd_pairs.stage_copies(pos)}
            self._sums = pair_sums.PairSums(  # issued and waited by the program's sum / summed ops
                {}, lambda c: sum_tensors(self.model[c]), pos.group,
                in_place=lambda c: is_wrapped(self.model[c]), timeout_s=BD_SUM_TIMEOUT_S,
                describe=lambda c: (f"global rank {pos.me}: the bd sum of stage {stage[c]} "
                                    f"with global rank {pos.partner}"))
        self._overlap: list = []  # (DDP config, its overlap_grad_reduce) while the schedule runs
        clear_deferred_output_wgrads(config, self.model)

    @contextlib.contextmanager
    def during_schedule(self):
        configs = {id(c.ddp_config): c.ddp_config for c in self.model if getattr(c, "ddp_config", None) is not None}
        self._overlap = [(cfg, cfg.overlap_grad_reduce) for cfg in configs.values()]
        self._set_overlap(False)
        try:
            yield
        finally:
            self._set_overlap(None)
            self._overlap = []

    def _set_overlap(self, value: Optional[bool]) -> None:
        """Set every DDP config's ``overlap_grad_reduce`` to ``value`` (None: as configured)."""
        for cfg, configured in self._overlap:
            cfg.overlap_grad_reduce = configured if value is None else value

    @contextlib.contextmanager
    def _as_configured(self):
        """``start_grad_sync`` as configured: asynchronous, it leaves the handle ``finish_grad_sync`` waits
        for; synchronous, ``finish_grad_sync`` reduced the bucket a second time (wrong for a reduce-scatter)."""
        self._set_overlap(None)
        try:
            yield
        finally:
            self._set_overlap(False)

    def on_reduction(self, kind: OpKind, c: int) -> None:
        """A ``final`` / ``sum`` / ``summed`` / ``settle`` / ``dp`` op of the rank's program."""
        if kind == OpKind.FINAL:
            if c not in self._done:
                self._done.add(c)
                _finish_deferred_output_wgrads(self.config, self.model[c])
        elif kind == OpKind.SETTLE:
            self._settle()
        elif kind == OpKind.DP:
            self._start_dp(c)
        elif kind not in (OpKind.SUM, OpKind.SUMMED):
            raise ValueError(f"not a reduction op: {kind!r}")
        elif self._sums is None:
            raise RuntimeError(f"megatron-dualpipe: the iteration plan sums chunk {c}'s copies, which this "
                               f"rank sums no other way than in its finalize (a bug)")
        else:
            (self._sums.issue if kind == OpKind.SUM else self._sums.wait)(c)

    def _start_dp(self, c: int) -> None:
        """Start chunk ``c``'s data-parallel reduction. Before its ``final`` op, or before the ``settle``
        that still changes its gradients, is a bug: raise, never reduce a partial gradient."""
        final = c in self._done and (self._settled or c not in self._settled_later)
        if c in self._dp_started or not final:
            raise RuntimeError(f"megatron-dualpipe: the iteration plan starts the data-parallel reduction of chunk {c} "
                               f"{'twice' if c in self._dp_started else 'before its gradients are final'} (a bug)")
        self._dp_started.add(c)
        if self._dp_start[c] is not None:
            with self._as_configured():
                self._dp_start[c](self.model[c].parameters())
            watch_dp_reduction(self.model[c], f"global rank {dist.get_rank()}, chunk {c}")

    def _settle(self) -> None:
        """After every sum is waited: the middle rank's local sum and the tied-embedding fold, which
        change gradients that the reductions started after them reduce."""
        if self._settled or (self._sums is not None and self._sums.pending):
            when = "twice" if self._settled else "before every bd sum is waited"
            raise RuntimeError(f"megatron-dualpipe: the program settles {when} (a bug)")
        self._settled = True
        if self._local_sum:
            allreduce_bd_grads(self.model)  # the middle rank of an odd pipeline sums locally
        if self._fold:
            fold_tied_embedding_grads(self.model)

    def complete(self) -> None:
        """The program's ops ran: every reduction must have started."""
        missed = sorted(set(range(len(self.model))) - self._dp_started)
        if missed:
            raise RuntimeError(f"megatron-dualpipe: the iteration plan starts no data-parallel reduction of "
                               f"chunk(s) {missed} (a bug)")


def _dp_start_functions(config, model) -> list:
    """Per chunk: what starts its data-parallel reduction early (``config.grad_sync_func``), or None
    (reduced in finalize). None too where a chunk has ``force_all_reduce`` (``--save-wgrads-interval``):
    ``start_grad_sync`` does not take it and would reduce-scatter."""
    funcs = config.grad_sync_func
    funcs = funcs if isinstance(funcs, list) else [funcs]  # None: [None] for every chunk
    funcs = funcs * len(model) if len(funcs) == 1 else list(funcs)
    return [None if getattr(chunk, "force_all_reduce", False) else f for f, chunk in zip(funcs, model)]


def _output_layer_module(config, chunk):
    """The GPT module whose output layer defers its weight gradients, or None."""
    if not getattr(config, "defer_embedding_wgrad_compute", False):
        return None
    m = unwrap_chunk(chunk)
    return m if getattr(m, "post_process", False) and getattr(m, "embedding_activation_buffer", None) is not None \
        else None


def clear_deferred_output_wgrads(config, model) -> None:
    """``--defer-embedding-wgrad-compute``: empty the output layer's deferred activations and output
    gradients, before a training run and after every evaluation run (nothing drains its forwards')."""
    for chunk in model:
        m = _output_layer_module(config, chunk)
        if m is not None:
            m.embedding_activation_buffer.clear()
            m.grad_output_buffer.clear()


def _finish_deferred_output_wgrads(config, chunk) -> None:
    """``--defer-embedding-wgrad-compute``: the output layer's weight gradients, deferred by its
    backward to the end of the chunk's micro-batches (Megatron's own drain, as its 1F1B calls).

    Megatron's drain (``megatron.core.utils.drain_embedding_wgrad_compute``) reads an unbound index when
    the buffers hold one entry: a chunk with one real micro-batch (DualPipe's padded iterations,
    pp <= M < 2*pp) or ``--wgrad-deferral-limit 1`` (Megatron's own 1F1B fails there too). A zero
    output gradient paired with the same input makes the entries two; its product adds exactly zero."""
    m = _output_layer_module(config, chunk)
    if m is None or not m.grad_output_buffer:
        return
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    if len(m.grad_output_buffer) == 1:
        m.embedding_activation_buffer.append(m.embedding_activation_buffer[0])
        m.grad_output_buffer.append(torch.zeros_like(m.grad_output_buffer[0]))
    schedules.finish_embedding_wgrad_compute(config, m, True, parallel_state.get_tensor_model_parallel_group())


def watch_dp_reduction(chunk, what: str) -> None:
    """Hand the works of ``chunk``'s started data-parallel reductions to the iteration's watchdog (accelerator
    only: on the host the wait is gloo's). DDP's ``finish_grad_sync`` waits for them with no deadline of ours, so
    a data-parallel peer that raised would hold it until NCCL's timeout; watched, they keep the iteration's
    deadline and stop at the abort signal, naming ``what`` (this rank and the chunk) and the reduction's ranks."""
    dog = watchdog.current()
    if dog is None or not waits_order_stream(next(chunk.parameters())):
        return
    for bucket_group in list(getattr(chunk, "bucket_groups", [])) + list(
            getattr(chunk, "expert_parallel_bucket_groups", [])):
        handle = getattr(bucket_group, "grad_reduce_handle", None)
        if handle is None:
            continue
        group = getattr(bucket_group, "intra_distributed_optimizer_instance_group", None) or \
            getattr(bucket_group, "data_parallel_group", None)
        ranks = dist.get_process_group_ranks(group) if group is not None else "?"
        for work in getattr(handle, "works", [handle]):
            dog.track(work, f"{what}: the data-parallel reduction over global ranks {ranks}")

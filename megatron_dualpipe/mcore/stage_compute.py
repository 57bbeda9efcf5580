"""What F, B, BW and W mean for this rank's megatron-core model chunks: megatron-core's own ``forward_step`` /
``backward_step``, so loss scaling, MoE aux-loss scaling and ``calculate_per_token_loss`` are Megatron's.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_type

from ..executor.runner import StageComputeBase
from ..schedule import B, Action
from ..schedule.lowering.program import Program
from .wgrad import TEQueues, offers_te_backward_dw
from . import compat
from .data import MicrobatchSource
from .direction import direction_of
from .model import unwrap_chunk


class MegatronStageCompute(StageComputeBase):
    """Chunk ``d`` of ``model`` serves direction ``d``; saved activations and deferred weight gradients are
    keyed by (direction, micro-batch, stage), never by order. Under a B action the local linears defer through
    ``WeightGradStore.deferring`` and what Transformer Engine queued is recorded under the same key, so W runs
    both; every backward of a TE chunk queues, so a BW pops its entries at once."""

    def __init__(self, *, program: Program, model: Sequence[torch.nn.Module], rank: int,
                 forward_step_func: Callable, source: MicrobatchSource, config, forward_only: bool,
                 collect_non_loss_data: bool, first_val_step, global_ranks, wgrad_store=None, audit=None):
        self.spec, self.layout, self.padded = program.schedule.spec, program.schedule.layout, program.padded
        self.model, self.rank, self.real = model, rank, program.padded.real  # Megatron's num_microbatches
        self.forward_step_func, self.source = forward_step_func, source
        self.config, self.forward_only, self.collect_non_loss_data = config, forward_only, collect_non_loss_data
        self.first_val_step, self.global_ranks = first_val_step, global_ranks
        self.wgrad_store, self.audit = wgrad_store, audit
        self.unwrapped = [unwrap_chunk(chunk) for chunk in model]
        self.te_queues = [TEQueues(chunk) if offers_te_backward_dw(chunk) else None for chunk in self.unwrapped]
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.model_type = get_model_type(model[0])
        self.saved: Dict[tuple, tuple] = {}
        self.loss_store: List[List[Any]] = [[] for _ in self.layout.directions]
        self.total_num_tokens: Optional[torch.Tensor] = None
        self.first_forward_done = [False] * len(model)

    def forward(self, a: Action, input_tensor):
        g, is_first_mb = self._begin_forward(a)
        with direction_of(self.layout, self.rank, a.dir, self.global_ranks):
            output, num_tokens = schedules.forward_step(
                self.forward_step_func, self.source.view(g), self.model[a.dir], self.real, input_tensor,
                self.loss_store[a.dir], self.config, self.cp_size,
                collect_non_loss_data=self.collect_non_loss_data, is_first_microbatch=is_first_mb,
                current_microbatch=g, is_last_stage=self.layout.is_last(a.dir, a.stage))
        self._end_forward(a, input_tensor, output, num_tokens)
        return output

    def backward(self, a: Action, output_grad):
        input_tensor, output = self.saved.pop((a.dir, a.mb, a.stage))
        queued = self._te_sizes(a.dir)
        with contextlib.ExitStack() as stack:
            deferring = self._defer_weight_grads(a, stack)
            input_grad = compat.backward_step(input_tensor, output, output_grad, self.model_type, self.config)
        self._te_backward_dw(a.dir, queued, (a.dir, a.mb, a.stage) if deferring else None)
        return input_grad

    # -- shared by the subclasses ---------------------------------------------------------------
    def _begin_forward(self, a: Action):
        """The global micro-batch index of ``a`` and whether it is its chunk's first forward."""
        is_first_mb = schedules.check_first_val_step(self.first_val_step, self.forward_only,
                                                     not self.first_forward_done[a.dir])
        self.first_forward_done[a.dir] = True
        return self.padded.global_index(a), is_first_mb

    def _end_forward(self, a: Action, input_tensor, output, num_tokens) -> None:
        # int32 on every pipeline rank, as Megatron's in-place sum (int64 made one all-reduce mix dtypes)
        tokens = num_tokens.to(dtype=torch.int)
        self.total_num_tokens = tokens if self.total_num_tokens is None else self.total_num_tokens + tokens
        if not self.forward_only:
            self.saved[(a.dir, a.mb, a.stage)] = (input_tensor, output)

    def _defer_weight_grads(self, a: Action, stack: contextlib.ExitStack) -> bool:
        """For a B action: enter the store's ``deferring`` block (and the audit's watch) on ``stack``."""
        if a.op != B or self.wgrad_store is None:
            return False
        stack.enter_context(self.wgrad_store.deferring((a.dir, a.mb, a.stage)))
        if self.audit is not None and self.audit.wants(a.dir):
            stack.enter_context(self.audit.watching(a.dir, f"stage {a.stage}", self.unwrapped[a.dir]))
        return True

    def _te_sizes(self, chunk: int):
        """The chunk's TE queues before a backward (None: no module of it defers)."""
        queues = self.te_queues[chunk]
        return queues.sizes() if queues is not None else None

    def _te_backward_dw(self, chunk: int, before, key) -> None:
        """What this backward left in TE's queues (since ``before``): W pops it (``key``), or now."""
        if before is None:
            return
        queues = self.te_queues[chunk]
        pushed = queues.pushed_since(before)
        if key is None:
            queues.pop(pushed)
        elif pushed:
            self.wgrad_store.record(key, functools.partial(queues.pop, pushed))

    def check_te_queues_empty(self) -> None:
        """The end of an iteration: no TE module may hold a deferred weight gradient."""
        for queues in self.te_queues:
            if queues is not None:
                queues.check_empty()

    def weight(self, a: Action) -> None:
        if self.wgrad_store is not None:
            self.wgrad_store.run((a.dir, a.mb, a.stage))

    def release(self, a: Action, output) -> None:
        schedules.deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

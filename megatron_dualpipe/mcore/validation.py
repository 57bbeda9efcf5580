"""Everything the executor's ``forward_backward_func`` can check before it communicates.

Every check raises :class:`DualPipeConfigError` naming the fix, on the rank that called, with no collective
started (a bad configuration never leaves a peer waiting): the registry's rules, and the options table
(:mod:`.options`) read from the model's ``TransformerConfig``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from megatron.core import parallel_state

from ..schedule.registry import ScheduleError, ScheduleSpec
from . import options


class DualPipeConfigError(ValueError):
    """A configuration DualPipe cannot run, found before any communication."""


def check_call(spec: ScheduleSpec, *, model: Sequence[torch.nn.Module], num_microbatches: int, forward_only: bool,
               adjust_tensor_shapes_fn, config, zero_bubble: bool, p2p_communicator, pg_collection,
               data_iterator) -> int:
    """Check one call of the schedule; return the number of micro-batches to run (padded)."""
    name = spec.name
    if p2p_communicator is not None or pg_collection is not None:
        raise DualPipeConfigError(f"{name} uses megatron-core's parallel_state groups; custom "
                                  f"p2p_communicator / pg_collection are not supported yet: pass p2p_communicator=None "
                                  f"and pg_collection=None, or use --pipeline-schedule 1f1b")
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    problem = spec.pp_problem(pp, flag="--pipeline-model-parallel-size")
    if problem:
        raise DualPipeConfigError(problem)
    ddp = next((c.ddp_config for c in model if getattr(c, "ddp_config", None) is not None), None)
    refused = options.problems(config, name, options.CONFIG) + (options.problems(ddp, name, options.DDP) if ddp else [])
    if zero_bubble and name in options.TE_BIASES_IN_W.schedules and options.TE_BIASES_IN_W.value(config, options.CONFIG):
        refused.append(options.TE_BIASES_IN_W.message())
    if refused:  # the options table, read from the TransformerConfig and the DDP config (as Megatron-LM's check reads args)
        raise DualPipeConfigError(f"{name}: " + f"; {name}: ".join(refused))
    if len(model) != spec.chunks_per_rank and spec.chunks_per_rank == 2:
        raise DualPipeConfigError(f"{name} needs 2 model chunks per rank, got {len(model)}: build the model with "
                                  f"megatron_dualpipe.mcore.model.build_two_direction_model")
    if len(model) != spec.chunks_per_rank:
        raise DualPipeConfigError(f"{name} runs one model chunk per rank, got {len(model)}: pass a single model (no "
                                  f"virtual pipeline), or use --pipeline-schedule dualpipe/dualpipev")
    if not forward_only:
        _check_te_deferral(name, config, model)
    if adjust_tensor_shapes_fn is not None:
        raise DualPipeConfigError(f"{name} does not support adjust_tensor_shapes_fn (ModelOpt distillation): run "
                                  f"distillation with --pipeline-schedule 1f1b, or pass adjust_tensor_shapes_fn=None")
    if isinstance(data_iterator, (list, tuple)) and len(data_iterator) != 1:
        raise DualPipeConfigError(f"{name} reads both directions from one data iterator; got a list of "
                                  f"{len(data_iterator)}: pass one iterator (or a list of one)")
    if num_microbatches < 1:
        raise DualPipeConfigError(f"need at least one micro-batch per iteration, got {num_microbatches}: raise "
                                  f"--global-batch-size")
    try:
        return spec.padded_microbatches(pp, num_microbatches, forward_only)
    except ScheduleError as e:
        raise DualPipeConfigError(str(e)) from None


def _check_te_deferral(name: str, config, model: Sequence[torch.nn.Module]) -> None:
    """Transformer Engine's ``backward_dw`` assigns each deferred weight gradient to ``param.grad``
    (it does not add); only megatron DDP built with ``delay_wgrad_compute`` hooks the deferring modules
    to add it to ``main_grad``. Without it every micro-batch's weight gradient would replace the
    previous one's, silently (Megatron-LM's DDP config takes the flag from its args)."""
    if not getattr(config, "delay_wgrad_compute", False):
        return
    for chunk in model:
        if getattr(getattr(chunk, "ddp_config", None), "delay_wgrad_compute", False):
            continue
        if any(getattr(p, "skip_backward_post_hook", False) for p in chunk.parameters()):
            raise DualPipeConfigError(
                f"{name}: delay_wgrad_compute: Transformer Engine's backward_dw assigns each weight gradient to "
                f"param.grad, and only megatron DDP's hooks add it up (without them each micro-batch's would replace "
                f"the last one's): set DistributedDataParallelConfig(delay_wgrad_compute=True) on the megatron DDP "
                f"wrapping every chunk, or turn off delay_wgrad_compute")


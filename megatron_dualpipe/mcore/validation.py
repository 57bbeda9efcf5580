"""Everything the executor's ``forward_backward_func`` can check before it communicates.

Every check raises :class:`DualPipeConfigError` naming the fix, on the rank that called, with no
collective started: a bad configuration never leaves a peer waiting. The schedule's own rules
(pipeline size, micro-batch counts, chunks per rank) come from the registry.
"""
from __future__ import annotations

from typing import Sequence

import torch
from megatron.core import parallel_state

from ..schedule.registry import ScheduleError, ScheduleSpec


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
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vp is not None and vp > 1:
        raise DualPipeConfigError(f"{name} cannot be combined with a virtual pipeline (size {vp}): remove "
                                  f"--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
    _check_chunks(spec, model)
    if adjust_tensor_shapes_fn is not None:
        raise DualPipeConfigError(f"{name} does not support adjust_tensor_shapes_fn (ModelOpt distillation): run "
                                  f"distillation with --pipeline-schedule 1f1b, or pass adjust_tensor_shapes_fn=None")
    if getattr(config, "variable_seq_lengths", False):
        raise DualPipeConfigError(f"{name} needs fixed shapes between micro-batches: turn off "
                                  f"variable_seq_lengths (every micro-batch must be seq_length x micro_batch_size)")
    if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        raise DualPipeConfigError(
            f"{name} does not support num_microbatches_with_partial_activation_checkpoints (Megatron's 1F1B picks, "
            f"per micro-batch, which ones recompute, from its own window of outstanding backwards): set it to None "
            f"and recompute every micro-batch alike (recompute_granularity / recompute_num_layers)")
    problem = fp8_delayed_problem(spec, pp, getattr(config, "fp8", None), getattr(config, "fp8_recipe", None))
    if problem:
        raise DualPipeConfigError(f"{name} {problem}")
    if getattr(config, "overlap_p2p_comm", False):
        raise DualPipeConfigError(f"{name} batches its own P2P: turn off --overlap-p2p-communication")
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


def fp8_delayed_problem(spec: ScheduleSpec, pp: int, fp8, recipe) -> str:
    """FP8 with the ``delayed`` recipe under a schedule with two copies of each stage: each copy
    keeps its own amax history, of its own direction's micro-batches, so the copies quantise
    with different scales and their weights drift apart. Refused (an amax reduction over the bd
    pair would be needed); '' when fine."""
    from ..schedule.layout import BIDIRECTIONAL

    if not fp8 or getattr(recipe, "value", recipe) != "delayed" or spec.layout(max(pp, 2)).kind != BIDIRECTIONAL:
        return ""
    return ("does not support --fp8-recipe delayed (each copy of a stage would keep its own amax history of its own "
            "direction's micro-batches, so the two copies would quantise with different scales and drift apart): use "
            "--fp8-recipe tensorwise, blockwise or mxfp8, or --pipeline-schedule dualpipev")


def _check_chunks(spec: ScheduleSpec, model: Sequence[torch.nn.Module]) -> None:
    chunks = spec.chunks_per_rank
    if len(model) == chunks:
        return
    if chunks == 2:
        raise DualPipeConfigError(
            f"{spec.name} needs {chunks} model chunks per rank, got {len(model)}: build the model with "
            f"megatron_dualpipe.mcore.model.build_two_direction_model")
    raise DualPipeConfigError(
        f"{spec.name} runs one model chunk per rank, got {len(model)}: pass a single model (no virtual "
        f"pipeline), or use --pipeline-schedule dualpipe/dualpipev")

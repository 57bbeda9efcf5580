"""Fused F&B units through megatron-core's combined forward-backward step.

In a fused unit one direction's forward runs with the other's backward, so that the MoE all-to-all of one
hides behind the other's compute: megatron-core's ``combined_1f1b.combined_forward_backward_step`` (its
interleaved 1F1B's ``--overlap-moe-expert-parallel-comm``) interleaves a forward and a *different* backward
chunk layer by layer. :class:`OverlappedStageCompute` sends every F, B, BW and fused unit through it (a
backward needs the schedule plan its forward left) and schedules nothing itself. Inside the step
``parallel_state`` answers for the forward's stage, ``forward_step_calc_loss`` is told where the forward's
direction ends (the step asks ``is_pipeline_last_stage()``), and a B defers its weight gradients to W.

megatron-core's ``TransformerConfig`` refuses the flag with pp > 1 unless a virtual pipeline is configured:
:func:`enable_combined_step` sets it on a config megatron-core already checked, after probing its remaining
checks (:func:`megatron_refuses`). Its bf16/fp16 demand is not needed: the step calls the unwrapped model,
whose one dtype step is the identity in fp32. On the CPU the sub-steps run in order on one stream.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Optional

from megatron.core.pipeline_parallel import combined_1f1b
from megatron.core.pipeline_parallel import utils as pp_utils

from .. import hooks
from . import compat
from ..schedule import Action
from . import options
from .options import COMBINED_STEP_FLAGS  # re-exported: the flags enable_combined_step sets after its checks
from .direction import direction_of
from .stage_compute import MegatronStageCompute
from .validation import DualPipeConfigError

log = logging.getLogger("megatron_dualpipe")
_CALC_LOSS = hooks.entry("scoped", "forward_step_calc_loss")

__all__ = ["COMBINED_STEP_FLAGS", "OverlappedStageCompute", "enable_combined_step",
           "enable_deferred_wgrads", "megatron_refuses", "offers_combined_step"]


def offers_combined_step(config, forward_only: bool = False) -> bool:
    """Whether an iteration runs through megatron-core's combined step (evaluation never does)."""
    return bool(getattr(config, "overlap_moe_expert_parallel_comm", False)) and not forward_only


def enable_combined_step(config, delay_wgrad_compute: Optional[bool] = None):
    """Turn on ``overlap_moe_expert_parallel_comm`` (and ``delay_wgrad_compute`` if given) on a checked
    ``TransformerConfig`` before the model is built; returns it. Raises :class:`DualPipeConfigError`."""
    problems = options.combined_step_problems(config, options.CONFIG)  # the options table's ``needs`` rules
    delay = bool(delay_wgrad_compute if delay_wgrad_compute is not None else config.delay_wgrad_compute)
    refused = megatron_refuses(config, overlap=True, delay=delay)
    if problems or refused:
        raise DualPipeConfigError("--overlap-moe-expert-parallel-comm with DualPipe: " + "; ".join(
            problems + ([f"megatron-core's TransformerConfig refuses it: {refused}"] if refused else [])))
    config.overlap_moe_expert_parallel_comm = True
    config.delay_wgrad_compute = delay
    return config


def enable_deferred_wgrads(config):
    """Turn on ``delay_wgrad_compute`` alone (W actions call TE's ``backward_dw()``) on a built config, after
    megatron-core's own checks of the flag (:func:`megatron_refuses`); returns it."""
    refused = megatron_refuses(config, overlap=False, delay=True)
    if refused:
        raise DualPipeConfigError(f"--delay-wgrad-compute with DualPipe: megatron-core's TransformerConfig refuses "
                                  f"it: {refused}")
    config.delay_wgrad_compute = True
    return config


def megatron_refuses(config, *, overlap: bool, delay: bool) -> Optional[str]:
    """megatron-core's message refusing the flags the plugin turns on after validation, or None: its own
    ``TransformerConfig`` checks on a probe copy (issue 35 found them never run). Only what DualPipe replaces is
    relaxed: the two chunks stand as a virtual pipeline of two (2 x pp even layers), fp32 as bf16."""
    import dataclasses
    import warnings

    pp = config.pipeline_model_parallel_size
    probe = dict(pipeline_model_parallel_layout=None, num_layers_in_first_pipeline_stage=None,
                 num_layers_in_last_pipeline_stage=None, account_for_embedding_in_pipeline_split=False,
                 account_for_loss_in_pipeline_split=False, overlap_moe_expert_parallel_comm=overlap,
                 delay_wgrad_compute=delay and overlap)
    if pp > 1:
        probe.update(virtual_pipeline_model_parallel_size=2, num_layers=2 * pp,
                     moe_layer_freq=config.moe_layer_freq if isinstance(config.moe_layer_freq, int) else 1)
    if overlap and not (config.bf16 or config.fp16):
        probe["bf16"] = True
    if delay and not overlap and getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False):
        return ("delay_wgrad_compute and overlap_dispatch_backward_with_experts_wgrad are mutually exclusive; use "
                "only one (megatron-core's rule, checked there only with the combined step on): remove "
                "--overlap-dispatch-backward-with-experts-wgrad")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dataclasses.replace(config, **{k: v for k, v in probe.items() if hasattr(config, k)})
    except (AssertionError, ValueError) as e:
        return str(e) or type(e).__name__
    return None


def _loss_where(is_last_stage: bool, cp_size: int):
    """Inside the combined step, ``forward_step_calc_loss`` (looked up at call time) is told where the direction
    ends."""

    def told(original):
        def forward_step_calc_loss(*args, **kwargs):
            kwargs["cp_group_size"], kwargs["is_last_stage"] = cp_size, is_last_stage
            return original(*args, **kwargs)

        return forward_step_calc_loss

    return hooks.scoped(_CALC_LOSS.made_by(told))


class OverlappedStageCompute(MegatronStageCompute):
    """:class:`MegatronStageCompute` whose F, B, BW and fused F&B units all run through the combined step."""

    #: Whether this process has said once that the combined step is in use.
    announced = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        _check_forward_step_func(self.forward_step_func)
        pp_utils.set_streams()  # once per process: the compute and communication streams
        if not OverlappedStageCompute.announced:
            OverlappedStageCompute.announced = True
            log.info("megatron-dualpipe: %s pipeline rank %d: fused F&B units run through megatron-core's combined "
                     "step (--overlap-moe-expert-parallel-comm)", self.spec.name, self.rank)

    def forward(self, a: Action, input_tensor):
        return self._combined(a, input_tensor, None, None)[0]

    def backward(self, a: Action, output_grad):
        return self._combined(None, None, a, output_grad)[1]

    def forward_backward(self, f_action: Action, b_action: Action, input_tensor, output_grad):
        """One direction's forward and the other's backward in one combined step."""
        return self._combined(f_action, input_tensor, b_action, output_grad)

    def _combined(self, fa: Optional[Action], input_tensor, ba: Optional[Action], output_grad):
        f_model = b_model = b_input = b_output = data = None
        g, is_first_mb, store = None, False, []
        with contextlib.ExitStack() as stack:
            if fa is not None:
                g, is_first_mb = self._begin_forward(fa)
                f_model, data, store = self.model[fa.dir], self.source.view(g), self.loss_store[fa.dir]
                stack.enter_context(direction_of(self.layout, self.rank, fa.dir, self.global_ranks))
                stack.enter_context(_loss_where(self.layout.is_last(fa.dir, fa.stage), self.cp_size))
            te_deferred = False
            if ba is not None:
                b_model = self.model[ba.dir]
                b_input, b_output = self.saved.pop((ba.dir, ba.mb, ba.stage))
                queued = self._te_sizes(ba.dir)
                te_deferred = self._defer_weight_grads(ba, stack) and queued is not None
                for layer in b_output.schedule_plan._transformer_layers if te_deferred else ():
                    for node in compat.layer_plan_nodes(layer).values():  # skip their backward_dw(): W computes it
                        if hasattr(node, "delay_wgrad_compute"):
                            node.delay_wgrad_compute = False
            output, num_tokens, input_grad = combined_1f1b.combined_forward_backward_step(
                self.forward_step_func, data, f_model, self.real, input_tensor, store, b_model, b_input, b_output,
                output_grad, self.config, collect_non_loss_data=self.collect_non_loss_data,
                is_first_microbatch=is_first_mb, current_microbatch=g)
        if ba is not None:  # what TE queued and megatron-core did not pop inline: W pops it (a B), or now
            self._te_backward_dw(ba.dir, queued, (ba.dir, ba.mb, ba.stage) if te_deferred else None)
        if fa is not None:
            self._end_forward(fa, input_tensor, output, num_tokens)
        return output, input_grad


def _check_forward_step_func(func) -> None:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return
    if "return_schedule_plan" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    raise DualPipeConfigError(
        "--overlap-moe-expert-parallel-comm needs a forward_step_func(data_iterator, model, "
        "return_schedule_plan=False) that returns (model.build_schedule_plan(...), loss_func) when "
        "return_schedule_plan is True, as Megatron-LM's pretrain_gpt.forward_step does")

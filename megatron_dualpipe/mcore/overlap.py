"""Fused F&B units through megatron-core's combined forward-backward step.

DualPipe's point on a GPU: in a fused unit one direction's forward runs together with the other
direction's backward, so that the MoE expert-parallel all-to-all of one hides behind the other's
compute. megatron-core 0.16.1 already has that machinery for its interleaved 1F1B
(``--overlap-moe-expert-parallel-comm``): ``pipeline_parallel.combined_1f1b.
combined_forward_backward_step`` takes a forward model chunk and a *different* backward model
chunk, and ``models.common.model_chunk_schedule_plan.TransformerModelChunkSchedulePlan.run``
interleaves them layer by layer (forward of layer ``k`` with backward of layer ``L-1-k``; per
layer: combine-backward, attention-forward, MLP-backward, dispatch-forward, MLP weight
gradient, dispatch-backward, MLP-forward, combine-forward, attention-backward, attention weight
gradient; the dispatch and combine run on a communication stream). This module runs DualPipe's
units through it; it adds no scheduling of its own.

:class:`OverlappedStageCompute` is the stage compute when the model offers the combined step
(``config.overlap_moe_expert_parallel_comm``; the MoE layers need the alltoall or flex
dispatcher and expert parallelism, which megatron-core checks): every forward and backward of the
iteration goes through ``combined_forward_backward_step`` (the backward needs the schedule plan
its forward left on the output tensor), a lone F with no backward model, a lone B/BW with no
forward model, a fused unit (the runner's ``forward_backward`` hook) with both. Everything else
(loss scaling, MoE aux-loss scale, ``calculate_per_token_loss``, token counts) is megatron-core's
own ``forward_step_calc_loss``, as in ``schedules.forward_step``.

What holds inside the combined step, for both chunks and every layout:

* the forward's direction: ``parallel_state`` answers for the forward's stage while the user's
  ``forward_step_func`` runs (``direction.direction_of``, as in a plain F);
* the loss is computed where the forward's *direction* ends, not where the physical pipeline
  ends: the combined step asks ``parallel_state.is_pipeline_last_stage()``, which is wrong for
  DualPipeV's direction 0 on the last rank (its stage ``pp-1`` is the turn of the V, not the
  end) and for DualPipe's direction 1. For the duration of the call,
  ``schedules.forward_step_calc_loss`` (looked up by the combined step at call time) receives
  ``is_last_stage`` from the layout and the context-parallel size, exactly as the executor's
  plain forward passes them;
* the embedding: each chunk was built with its own ``pre_process``/``post_process``
  (``mcore.model``), which is what the schedule plan's pre- and post-process nodes read;
* zero bubble: a B action runs inside ``WeightGradStore.deferring`` (local linears defer their
  weight gradients to W); fused units carry full backwards (BW), as in DeepSeek's reference.

The pp/vpp assertion: megatron-core's ``TransformerConfig`` refuses
``overlap_moe_expert_parallel_comm`` with ``pipeline_model_parallel_size > 1`` unless a virtual
pipeline is configured, because its only combined path with pipelining is the interleaved one.
DualPipe supplies the fused units itself, so :func:`enable_combined_step` sets the flag on a
config that megatron-core has already checked, after checking the remaining requirements of the
combined step itself (an adapter: megatron-core is not modified). DualPipeV's chunks are built
with ``virtual_pipeline_model_parallel_size=2`` (``mcore.model.dualpipev_config``) and pass the
assertion as they are. megatron-core also asks for bf16/fp16; the adapter does not: the combined
step calls the unwrapped ``GPTModel`` (bypassing ``Float16Module``'s casts) and its only
dtype-specific step is the fp16-to-fp32 cast of the loss, which is the identity in fp32 (the CPU
proof runs in fp32).

* Transformer Engine with ``delay_wgrad_compute``: the schedule plan calls each layer's
  ``backward_dw()`` itself. For a B action its layer nodes are told not to
  (``_no_inline_weight_grads``) and the chunk's ``backward_dw()`` is recorded for the W action, as
  in the plain path; fused units and BW keep megatron-core's inline calls (full backwards). The
  wiring is tested on CPU with the local spec standing in for TE (its ``backward_dw`` are no-ops);
  the TE kernels need a GPU.

MTP: one layer (megatron-core's own limit; more are refused), its loss as the plan's post-process
node, proven in tests/megatron_lm/test_megatron_lm_mtp.py. Not covered: CUDA graphs. On the CPU the sub-steps run in order on one stream:
the order and the numbers are verified there, the overlap itself only exists on a GPU.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import List, Optional

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

__all__ = ["COMBINED_STEP_FLAGS", "OverlappedStageCompute", "combined_step_problems", "enable_combined_step",
           "enable_deferred_wgrads", "megatron_refuses", "offers_combined_step"]


def offers_combined_step(config, forward_only: bool = False) -> bool:
    """Whether an iteration runs through megatron-core's combined step (evaluation never does)."""
    return bool(getattr(config, "overlap_moe_expert_parallel_comm", False)) and not forward_only


def combined_step_problems(config) -> List[str]:
    """What megatron-core's combined step needs besides the virtual pipeline (its
    ``TransformerConfig`` checks, minus pp/vpp and bf16/fp16: see the module docstring; CUDA
    graphs, which it also restricts, DualPipe refuses anyway): the ``needs`` rules of the options
    table (:mod:`.options`), read from a ``TransformerConfig``."""
    return options.combined_step_problems(config, options.CONFIG)


def enable_combined_step(config, delay_wgrad_compute: Optional[bool] = None):
    """Turn on ``overlap_moe_expert_parallel_comm`` (and ``delay_wgrad_compute`` if given) on a
    ``TransformerConfig`` that megatron-core has built and checked; returns it.

    Raises :class:`DualPipeConfigError` listing what the combined step needs. Call it before the
    model is built (the chunks share the config object)."""
    problems = combined_step_problems(config)
    delay = bool(delay_wgrad_compute if delay_wgrad_compute is not None else config.delay_wgrad_compute)
    refused = megatron_refuses(config, overlap=True, delay=delay)
    if problems or refused:
        raise DualPipeConfigError("--overlap-moe-expert-parallel-comm with DualPipe: " + "; ".join(
            problems + ([f"megatron-core's TransformerConfig refuses it: {refused}"] if refused else [])))
    config.overlap_moe_expert_parallel_comm = True
    config.delay_wgrad_compute = delay
    return config


def enable_deferred_wgrads(config):
    """Turn on ``delay_wgrad_compute`` alone (zero bubble through Transformer Engine's deferral: the
    executor's W actions call ``backward_dw()``) on a config megatron-core has built; returns it.
    megatron-core's own checks of the flag run first (:func:`megatron_refuses`)."""
    refused = megatron_refuses(config, overlap=False, delay=True)
    if refused:
        raise DualPipeConfigError(f"--delay-wgrad-compute with DualPipe: megatron-core's TransformerConfig refuses "
                                  f"it: {refused}")
    config.delay_wgrad_compute = True
    return config


def megatron_refuses(config, *, overlap: bool, delay: bool) -> Optional[str]:
    """megatron-core's own ``TransformerConfig`` checks of the flags the plugin turns on after the
    config was validated without them (findings of issue 35: EP overlap with ``moe`` recomputed,
    ``delay_wgrad_compute`` with ``overlap_dispatch_backward_with_experts_wgrad`` were never checked),
    run on a probe copy. What DualPipe replaces is relaxed in the probe, nothing else: its two chunks
    per rank stand as megatron-core's virtual pipeline of two (its pp/vpp assertion; the split is
    probed as 2 x pp even layers, the split's own checks having run on the config), fp32 as bf16
    (see the module docstring), and ``delay_wgrad_compute`` alone is probed with the combined step's
    flag on only where megatron-core asks for it: ``megatron-core's message``, or None."""
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
    """Inside the combined step, ``forward_step_calc_loss`` is told where the direction ends
    (a ``hooks.scoped`` swap of ``schedules.forward_step_calc_loss``, looked up at call time)."""

    def told(original):
        def forward_step_calc_loss(*args, **kwargs):
            kwargs["cp_group_size"], kwargs["is_last_stage"] = cp_size, is_last_stage
            return original(*args, **kwargs)

        return forward_step_calc_loss

    return hooks.scoped(_CALC_LOSS.made_by(told))


class OverlappedStageCompute(MegatronStageCompute):
    """:class:`MegatronStageCompute` whose F, B, BW and fused F&B units all run through
    megatron-core's ``combined_forward_backward_step`` (see the module docstring)."""

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
                if te_deferred:
                    _no_inline_weight_grads(b_output.schedule_plan)
            output, num_tokens, input_grad = combined_1f1b.combined_forward_backward_step(
                self.forward_step_func, data, f_model, self.real, input_tensor, store, b_model, b_input, b_output,
                output_grad, self.config, collect_non_loss_data=self.collect_non_loss_data,
                is_first_microbatch=is_first_mb, current_microbatch=g)
        if ba is not None:  # what TE queued and megatron-core did not pop inline: W pops it (a B), or now
            self._te_backward_dw(ba.dir, queued, (ba.dir, ba.mb, ba.stage) if te_deferred else None)
        if fa is not None:
            self._end_forward(fa, input_tensor, output, num_tokens)
        return output, input_grad


def _no_inline_weight_grads(plan) -> None:
    """The schedule plan's layer nodes skip their ``backward_dw()`` (a B action: W computes them)."""
    for layer in plan._transformer_layers:
        for node in compat.layer_plan_nodes(layer).values():
            if hasattr(node, "delay_wgrad_compute"):
                node.delay_wgrad_compute = False


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

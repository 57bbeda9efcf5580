"""The options of a running job that decide its collectives after the schedule.

:class:`~..schedule.step_collectives.StepOptions` becomes each rank's ``coll`` ops, checked with the schedule's
communication, so they are read from what every rank has alike (configs, parallel sizes, Megatron-LM's
arguments). Where it cannot tell (megatron-core alone) a collective counts as issued: one every member leaves
out only removes waits, so the proof covers the run without it.
"""
from __future__ import annotations

from typing import Sequence, Tuple

from megatron.core import parallel_state

from ..schedule.step_collectives import StepOptions
from . import copies
from .model import unwrap_chunk

__all__ = ["StepOptions", "step_options"]


def _megatron_lm_args():
    """Megatron-LM's parsed arguments, or None (megatron-core alone, or not parsed)."""
    try:
        from megatron.training import get_args

        return get_args()
    except (ImportError, AssertionError):
        return None


def moe_logged(config) -> Tuple[str, ...]:
    """The MoE metrics Megatron-LM's ``training_log`` tracks, in its order and by its own tests."""
    if not getattr(config, "num_moe_experts", None):
        return ()
    balancing = getattr(config, "moe_router_load_balancing_type", None) or ()
    names = [name for key, name in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
                                    ("global_aux_loss", "global_load_balancing_loss")) if key in balancing]
    return tuple(names + (["z_loss"] if getattr(config, "moe_z_loss_coeff", None) is not None else []))


def step_options(model: Sequence, config, *, drift_check: bool, advise: bool) -> StepOptions:
    """This job's :class:`StepOptions` (module docstring)."""
    ddp = getattr(model[0], "ddp_config", None)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    args = _megatron_lm_args()

    def lm(*names, default=False) -> bool:
        """Whether any of Megatron-LM's arguments ``names`` is set (True without Megatron-LM: issued)."""
        return args is None or any(bool(getattr(args, n, default)) for n in names)

    if args is not None:  # Megatron's timers' log level: Megatron-LM's argument, else the config's timers'
        timing_level = int(getattr(args, "timing_log_level", 0))
    else:
        timers = getattr(config, "timers", None)
        timing_level = 0 if timers is None else int(getattr(timers, "_log_level", 2))
    return StepOptions(
        tp_grads=tp > 1 and bool(getattr(config, "sequence_parallel", False) or getattr(config, "qk_layernorm", False)),
        moe=bool(getattr(config, "num_moe_experts", None)),
        fp16=bool(getattr(config, "fp16", False)),
        distributed_optimizer=bool(ddp is not None and ddp.use_distributed_optimizer),
        overlap_param_gather=bool(ddp is not None and ddp.overlap_param_gather),
        expert_bias=bool(getattr(config, "moe_router_enable_expert_bias", False)),
        quantile_balancing="quantile_balancing" in (balancing if isinstance(balancing, (list, tuple)) else [balancing]),
        copy_sum=copies.of(model).way,
        per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
        tied_embeddings=bool(getattr(unwrap_chunk(model[0]), "share_embeddings_and_output_weights", False)
                             or getattr(config, "mtp_num_layers", None)),
        drift_check=drift_check, advise=advise, log_zeros=lm("log_num_zeros_in_grad"), megatron_lm=True,
        rerun=args is None or getattr(args, "rerun_mode", "validate_results") != "disabled",
        params_norm=lm("log_params_norm"), moe_logged=moe_logged(config),
        mtp=bool(getattr(config, "mtp_num_layers", None)), exit_signal=lm("exit_signal_handler"),
        exit_duration=lm("exit_duration_in_mins", default=None), async_save=lm("async_save"),
        qk_logits=lm("qk_clip", "log_max_attention_logit"), timing_level=timing_level,
        l1_barrier=bool(getattr(config, "barrier_with_L1_time", True)), timers_written=lm("log_timers_to_tensorboard"))

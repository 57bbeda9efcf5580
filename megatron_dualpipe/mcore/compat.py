"""What differs between the supported megatron-core versions on the path the executor calls.

The one place the executor's megatron-core calls adapt to the version (the supported range is
:mod:`megatron_dualpipe.versions`). Each difference is detected from Megatron's own code (a
signature, an attribute), not from a version number, so a release in between (0.17, 0.18)
takes the branch its code needs; each names the versions where it was read.

What did *not* need an entry, read at core_v0.16.1 and core_v0.19.0:

* ``schedules.forward_step`` (same positional order) computes the MoE / MTP auxiliary-loss
  scales itself; 0.19 takes them from ``config.moe_grad_scale_func`` / ``mtp_grad_scale_func``
  through ``_get_moe_loss_scale`` / ``_get_mtp_loss_scale``. The executor calls ``forward_step``
  (and the combined step calls ``forward_step_calc_loss``), so it scales exactly as 1F1B does.
* ``combined_1f1b.combined_forward_backward_step`` kept its signature; the schedule plan's
  ``_transformer_layers`` and their ``delay_wgrad_compute`` nodes are where they were.
* The duties 0.19's schedules gained at their ends (``off_interface.reset()`` for
  ``--fine-grained-activation-offloading``, ``create_cudagraphs()`` for ``--cuda-graph-impl
  local``, ``paged_stash_reset`` at the start for ``--moe-paged-stash``) belong to options that
  the executor schedules refuse (the options table, :mod:`.options`, read from the config at call
  time), so an executor iteration owes none.
"""
from __future__ import annotations

import functools
import inspect
from megatron.core.pipeline_parallel import schedules

__all__ = ["backward_step"]


@functools.lru_cache(maxsize=None)
def _backward_step_takes_model_type() -> bool:
    """megatron-core 0.16.x: ``backward_step(input_tensor, output_tensor, output_tensor_grad,
    model_type, config)``; 0.19 (the argument was unused and dropped): ``(..., config)``."""
    return "model_type" in inspect.signature(schedules.backward_step).parameters


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """megatron-core's ``schedules.backward_step`` with the arguments its version takes
    (looked up at call time, so a wrapper installed on it is honoured)."""
    if _backward_step_takes_model_type():
        return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)

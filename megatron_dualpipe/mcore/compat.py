"""What differs between the supported megatron-core versions on the path the executor calls.

The one place the executor's megatron-core calls adapt to the version (the supported range is
:mod:`megatron_dualpipe.versions`). Each difference is detected from Megatron's own code (a
signature, an attribute), not from a version number (0.17 and 0.18, which are not supported, would
take the branch their code needs); each names the versions where it was read.

What did *not* need an entry, read at core_v0.16.1 and core_v0.19.0:

* ``schedules.forward_step`` (same positional order) computes the MoE / MTP auxiliary-loss
  scales itself; 0.19 takes them from ``config.moe_grad_scale_func`` / ``mtp_grad_scale_func``
  through ``_get_moe_loss_scale`` / ``_get_mtp_loss_scale``. The executor calls ``forward_step``
  (and the combined step calls ``forward_step_calc_loss``), so it scales exactly as 1F1B does.
* ``combined_1f1b.combined_forward_backward_step`` kept its signature; the schedule plan's
  ``_transformer_layers`` and their ``delay_wgrad_compute`` nodes are where they were.
* The duties 0.19's schedules gained at their ends (``off_interface.reset()`` for
  ``--fine-grained-activation-offloading``, ``create_cudagraphs()`` for ``--cuda-graph-impl
  local``, ``paged_stash_reset`` at the start for ``--moe-paged-stash``; the
  ``FullCudaGraphWrapper`` / ``PagedStashRunner`` around the function) belong to options that
  the executor schedules refuse (the rules of :mod:`.options`), so an executor iteration owes none.
"""
from __future__ import annotations

import functools
import inspect
from megatron.core.pipeline_parallel import schedules

__all__ = ["backward_step", "layer_plan_nodes", "transformer_layer_node_class", "LAYER_PLAN_NODES"]


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


def transformer_layer_node_class():
    """The schedule node class of one transformer layer's sub-module in the combined step (its
    ``backward_dw`` runs a layer's deferred weight gradients): ``models.gpt.fine_grained_callables.
    TransformerLayerNode`` at 0.16.x, moved to the model-agnostic ``models.common.utils`` in 0.19."""
    from megatron.core.models.gpt import fine_grained_callables

    found = getattr(fine_grained_callables, "TransformerLayerNode", None)
    if found is None:
        from megatron.core.models.common import utils

        found = utils.TransformerLayerNode
    return found


#: The nodes of one layer's schedule plan (``TransformerLayerSchedulePlan``), under the names
#: this project uses -> the attribute at 0.16.x and at 0.19: the attention node, ``attn``,
#: became ``pre_dispatch_computation`` (attention -> layernorm -> router -> dispatch preprocess).
LAYER_PLAN_NODES = {"attn": ("attn", "pre_dispatch_computation"), "moe_dispatch": ("moe_dispatch",),
                    "mlp": ("mlp",), "moe_combine": ("moe_combine",), "mtp_post_process": ("mtp_post_process",)}


def layer_plan_nodes(layer_plan) -> dict:
    """``{name: node}`` of :data:`LAYER_PLAN_NODES` for one layer's schedule plan (a node the layer
    does not have, e.g. the MoE ones of a dense layer, is None)."""
    nodes = {}
    for name, attributes in LAYER_PLAN_NODES.items():
        nodes[name] = next((getattr(layer_plan, a) for a in attributes if getattr(layer_plan, a, None) is not None),
                           None)
    return nodes

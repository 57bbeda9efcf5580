"""What differs between the supported megatron-core versions on the path the executor calls, detected from
Megatron's own code (a signature, an attribute), not from a version number. Read at core_v0.16.1 and
core_v0.19.0 and needing no entry: ``forward_step`` / ``forward_step_calc_loss`` (0.19 takes the MoE / MTP loss
scales from the config, so the executor scales as 1F1B does), ``combined_forward_backward_step``'s signature,
and the duties 0.19's schedules gained at their ends, whose options the executor refuses.
"""
from __future__ import annotations

import functools
import inspect
from megatron.core.pipeline_parallel import schedules

__all__ = ["backward_step", "layer_plan_nodes", "transformer_layer_node_class", "LAYER_PLAN_NODES"]


@functools.lru_cache(maxsize=None)
def _backward_step_takes_model_type() -> bool:
    """megatron-core 0.16.x's ``backward_step`` takes ``model_type`` before ``config``; 0.19 dropped it."""
    return "model_type" in inspect.signature(schedules.backward_step).parameters


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """``schedules.backward_step`` with the arguments its version takes (looked up at call time, so a wrapper
    installed on it is honoured)."""
    if _backward_step_takes_model_type():
        return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    return schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


def transformer_layer_node_class():
    """The combined step's node class of a transformer layer's sub-module: ``TransformerLayerNode`` in
    ``models.gpt.fine_grained_callables`` at 0.16.x, in ``models.common.utils`` at 0.19."""
    from megatron.core.models.gpt import fine_grained_callables

    if hasattr(fine_grained_callables, "TransformerLayerNode"):
        return fine_grained_callables.TransformerLayerNode
    from megatron.core.models.common import utils

    return utils.TransformerLayerNode


#: The nodes of one layer's schedule plan (``TransformerLayerSchedulePlan``), under the names
#: this project uses -> the attribute at 0.16.x and at 0.19: the attention node, ``attn``,
#: became ``pre_dispatch_computation`` (attention -> layernorm -> router -> dispatch preprocess).
LAYER_PLAN_NODES = {"attn": ("attn", "pre_dispatch_computation"), "moe_dispatch": ("moe_dispatch",),
                    "mlp": ("mlp",), "moe_combine": ("moe_combine",), "mtp_post_process": ("mtp_post_process",)}


def layer_plan_nodes(layer_plan) -> dict:
    """``{name: node}`` of :data:`LAYER_PLAN_NODES` for one layer's schedule plan (None where the layer has no
    such node, e.g. the MoE ones of a dense layer)."""
    return {name: next((getattr(layer_plan, a) for a in attributes if getattr(layer_plan, a, None) is not None), None)
            for name, attributes in LAYER_PLAN_NODES.items()}

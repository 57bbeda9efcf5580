"""A stage's parameters under the full (pp=1) model's names, so that every schedule's stages and
a single-process model load from one state dict and compare name by name. A stage's
``decoder.layers.i`` is global layer ``offset + i``; a tied last stage's output layer is the embedding.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch

_OUTPUT_WEIGHT = "output_layer.weight"
_EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"
_LAYERS = "decoder.layers."


def stage_layer_key(key: str, layer_offset: int) -> str:
    """A stage model's state-dict key as the full model's (layer index shifted by the offset)."""
    if key.startswith(_LAYERS):
        index, rest = key[len(_LAYERS):].split(".", 1)
        return f"{_LAYERS}{int(index) + layer_offset}.{rest}"
    return key


def full_key(key: str, layer_offset: int, full_keys) -> str:
    """:func:`stage_layer_key`, and the tied output layer as the embedding it is."""
    name = stage_layer_key(key, layer_offset)
    if name == _OUTPUT_WEIGHT and name not in full_keys and _EMBEDDING_WEIGHT in full_keys:
        return _EMBEDDING_WEIGHT
    return name


def layer_offset(stage_model) -> int:
    """The global index of the stage's first layer (0 for a stage without layers)."""
    layers = stage_model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def load_stage_from_full(stage_model, full_state_dict: Dict[str, torch.Tensor]) -> None:
    """Copy the matching tensors of a full (pp=1) model's state dict into a stage model."""
    offset = layer_offset(stage_model)
    missing = []
    with torch.no_grad():
        for key, tensor in stage_model.state_dict().items():
            if key.endswith("_extra_state"):
                continue
            name = full_key(key, offset, full_state_dict)
            if name not in full_state_dict:
                missing.append(name)
                continue
            tensor.copy_(full_state_dict[name])
    if missing:
        raise KeyError(f"keys missing from the full model: {missing}")


def by_full_name(chunk, full_keys, value: Callable[[torch.nn.Parameter], Any]) -> Dict[str, Any]:
    """``value(parameter)`` of every parameter of a stage (or its DDP wrapper) under the full model's
    name, where not None (a tied embedding under one name on the first and the last stage)."""
    inner = getattr(chunk, "module", chunk)
    offset = layer_offset(inner)
    out = {}
    for name, param in inner.named_parameters():
        got = value(param)
        if got is not None:
            out[full_key(name, offset, full_keys)] = got
    return out


def grad_of(param) -> Any:
    """The parameter's gradient: DDP's ``main_grad`` where there is one, else ``.grad`` (or None)."""
    g = getattr(param, "main_grad", None)
    g = param.grad if g is None else g
    return None if g is None else g.detach().clone()


def stage_grads_as_full(stage_model, full_keys) -> Dict[str, torch.Tensor]:
    """The stage's parameter gradients keyed by the full model's parameter names."""
    return by_full_name(stage_model, full_keys, grad_of)

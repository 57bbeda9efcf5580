"""Tiny bfloat16 MoE GPTs on the CPU stand-ins of grouped_gemm and DeepEP, for the stand-in tests.

:func:`start` is what a worker process does first: install the stand-ins, switch the CPU mode on
and start gloo with ``ep`` expert-parallel ranks, then make megatron-core's MoE modules see the
stand-ins (the harness's forkserver imported them before). Megatron's ``torch.compile``'d helpers
(``jit_fuser``: the flex dispatcher's ``dispatch_preprocess``, GroupedMLP's activation) run eagerly,
as in the selftest: inductor would compile C++ on every rank.

The models are bfloat16 because the libraries are: DeepEP combines bfloat16 only, grouped_gemm
multiplies bfloat16 only (and GroupedMLP asserts ``config.bf16``). The router runs in float32, as
DeepEP wants its weights.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import numpy as np
import torch

from megatron_dualpipe.proof import tiny_gpt
from megatron_dualpipe.proof.compare import Gap
from megatron_dualpipe.proof.data import masked_loss_func
from megatron_dualpipe.proof.models import ModelSpec

from . import megatron_env as me

#: The data: the proof harness's tiny GPT shape (vocabulary 64, 16 tokens, 2 samples).
DATA = ModelSpec(layers=1)


def start(rank: int, world_size: int, port: int, libraries: Sequence[str], ep: int) -> None:
    """Stand-ins installed, CPU mode on, gloo with ``ep``, megatron-core rebound, compile eager."""
    from megatron_dualpipe.cpu import stand_ins
    from megatron_dualpipe.cpu.stand_ins import megatron_rebind

    assert sorted(stand_ins.install(list(libraries))) == sorted(libraries), "a real library is installed"
    me.init_distributed_cpu(rank, world_size, port, ep=ep)
    megatron_rebind.rebind(libraries)
    torch.compiler.set_stance("force_eager")


def moe_config(dispatcher: str, grouped: bool = False, **overrides):
    """Tiny bfloat16 MoE: 1 layer, 4 experts, top-2, float32 router, ``dispatcher``'s token dispatch."""
    return tiny_gpt.tiny_gpt_config(
        num_layers=1, num_moe_experts=4, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, moe_router_dtype="fp32",
        **overrides)


def build(config, state=None):
    """The tiny GPT of ``config`` (local spec) in megatron-core's ``Float16Module``, as Megatron-LM
    runs ``--bf16``; with ``state``, those weights (the inner model's state dict)."""
    from megatron.core.transformer.module import Float16Module

    tiny_gpt.seed_all(1234)
    model = Float16Module(config, tiny_gpt.build_tiny_gpt(config))
    if state is not None:
        missing, unexpected = model.module.load_state_dict(state, strict=False)
        assert not [k for k in missing if "_extra_state" not in k], missing
        assert not [k for k in unexpected if "_extra_state" not in k], unexpected
    return model


def loss_and_grads(model, batch) -> Tuple[float, Dict[str, torch.Tensor]]:
    """Forward and backward on one micro-batch: the loss and every gradient, in float32."""
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss, _ = masked_loss_func(batch["loss_mask"], out)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def compare(label: str, got: Dict[str, np.ndarray], want: Dict[str, np.ndarray], rtol: float) -> Gap:
    """Every gradient of ``want`` against ``got``: one printed line, the largest difference named."""
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))
    gap = Gap()
    for name in sorted(want):
        gap.add(got[name], want[name], name)
    print(f"  {gap.line(label)}; worst single tensor rel {gap.worst:.2e} at {gap.worst_where}")
    assert gap.rel <= rtol and np.isfinite(gap.rel), gap.line(label)
    return gap


# ----------------------------------------------------------------------------------------------
# GroupedMLP <-> SequentialMLP weights (megatron-core 0.16.1's legacy GroupedMLP)
#
# GroupedMLP keeps all local experts in two matrices and reads them as ``weight1.view(E, H, F1)``
# and ``weight2.view(E, F, H)`` (experts.py), i.e. expert i's fc1 is ``[H, F1]``, the transpose of
# SequentialMLP's ``local_experts.i.linear_fc1.weight`` ``[F1, H]``; megatron-core's own checkpoint
# conversion (GroupedMLP.sharded_state_dict: sh_ten_build_fn / sh_ten_merge_fn) maps them so.

_FC1, _FC2 = "linear_fc1.weight", "linear_fc2.weight"


def has_legacy_grouped_mlp() -> bool:
    """Whether the installed megatron-core has the legacy GroupedMLP (0.16; gone in 0.19), read from
    its source so that a test can skip before starting processes."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.core.transformer.moe.experts")
    with open(spec.origin, encoding="utf-8") as source:
        return "\nclass GroupedMLP(" in source.read()


def _expert_weights(state, prefix: str, which: str):
    found, i = [], 0
    while f"{prefix}local_experts.{i}.{which}" in state:
        found.append(state[f"{prefix}local_experts.{i}.{which}"])
        i += 1
    return torch.stack(found)


def grouped_state(sequential_model) -> dict:
    """The state dict of ``sequential_model`` (built by :func:`build`) with each layer's experts as
    GroupedMLP's weight1 / weight2."""
    state = sequential_model.module.state_dict()
    prefixes = {k.split("local_experts.")[0] for k in state if "local_experts." in k}
    for prefix in prefixes:
        fc1, fc2 = _expert_weights(state, prefix, _FC1), _expert_weights(state, prefix, _FC2)
        hidden = fc1.size(2)
        state[f"{prefix}weight1"] = fc1.transpose(1, 2).reshape(hidden, -1)  # [E, H, F1] read as [H, E*F1]
        state[f"{prefix}weight2"] = fc2.transpose(1, 2).reshape(-1, hidden)  # [E, F, H] as [E*F, H]
    return {k: v for k, v in state.items() if "local_experts." not in k}


def sequential_grads(grads: Dict[str, torch.Tensor], config) -> Dict[str, torch.Tensor]:
    """GroupedMLP's weight1 / weight2 gradients under SequentialMLP's per-expert names."""
    out = {}
    fc1_width = config.moe_ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    for name, grad in grads.items():
        prefix, _, last = name.rpartition(".")
        if last == "weight1" and prefix.endswith(".experts"):
            per_expert = grad.reshape(-1, config.hidden_size, fc1_width).transpose(1, 2)
            which = _FC1
        elif last == "weight2" and prefix.endswith(".experts"):
            per_expert = grad.reshape(-1, config.moe_ffn_hidden_size, config.hidden_size).transpose(1, 2)
            which = _FC2
        else:
            out[name] = grad
            continue
        for i, g in enumerate(per_expert):
            out[f"{prefix}.local_experts.{i}.{which}"] = g.contiguous()
    return out

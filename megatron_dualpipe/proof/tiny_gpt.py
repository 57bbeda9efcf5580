"""A tiny megatron-core GPT and what comparing its pipeline stages needs: the model, random
micro-batches, the masked loss, and the mapping of a stage's parameter names to the full (pp=1)
model's.

Shared by ``megatron-dualpipe selftest`` and the tests (``tests/harness/megatron_env.py`` re-exports
it): the selftest must not import ``tests/``, and the tests and the selftest must build the same
model. ``build_tiny_gpt(..., layer_spec="te")`` builds it with Transformer Engine layers (GPU).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

def seed_all(seed: int) -> None:
    """Seed torch's default generator and megatron's model-parallel RNG tracker."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def tiny_gpt_config(
    *,
    num_layers: int = 4,
    hidden_size: int = 32,
    num_attention_heads: int = 4,
    num_moe_experts: Optional[int] = None,
    **overrides: Any,
):
    """A small float32 `TransformerConfig`, dropout off, CPU initialization, no fusions.

    With `num_moe_experts` it is an MoE config (SequentialMLP experts, top-2 router, allgather
    dispatcher unless `moe_token_dispatcher_type` is overridden, no aux loss unless overridden,
    no linear biases).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    kwargs: Dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=4 * hidden_size,
        num_attention_heads=num_attention_heads,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        init_method_std=0.02,
    )
    if parallel_state.model_parallel_is_initialized():
        kwargs["tensor_model_parallel_size"] = parallel_state.get_tensor_model_parallel_world_size()
        kwargs["pipeline_model_parallel_size"] = (
            parallel_state.get_pipeline_model_parallel_world_size()
        )
        kwargs["expert_model_parallel_size"] = parallel_state.get_expert_model_parallel_world_size()
    if num_moe_experts is not None:
        kwargs.update(
            num_moe_experts=num_moe_experts,
            moe_router_topk=2,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none",
            moe_ffn_hidden_size=2 * hidden_size,
            # SequentialMLP experts with biases fail in megatron-core 0.16.1 on any device:
            # `output += output_bias * per_token_scale` (mlp.py) modifies in place the view
            # returned by _ReduceFromModelParallelRegion (RuntimeError from autograd).
            add_bias_linear=False,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_tiny_gpt(
    config,
    *,
    vocab_size: int = 64,
    max_sequence_length: int = 16,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    share_embeddings_and_output_weights: bool = False,
    layer_spec: str = "local",
    **kwargs: Any,
):
    """`GPTModel` with the local layer spec (``layer_spec="te"``: Transformer Engine's).

    `pre_process` / `post_process` default to the stage predicates of `parallel_state`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    if layer_spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm
        )
    elif layer_spec == "local":
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm
        )
    else:
        raise ValueError(f"layer_spec must be 'local' or 'te', got {layer_spec!r}")
    return GPTModel(
        config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        **kwargs,
    )


def make_gpt_batches(n: int, *, vocab: int, seq: int, mbs: int, seed: int = 7) -> List[Dict[str, torch.Tensor]]:
    """``n`` random micro-batches (tokens, labels, position ids, loss mask), the same for a seed.

    The last three positions of every sample are masked out, so a per-token average that
    ignored the mask would not match.
    """
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
        loss_mask = torch.ones(mbs, seq)
        loss_mask[:, -3:] = 0.0
        batches.append(dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                            position_ids=torch.arange(seq).unsqueeze(0).expand(mbs, -1).contiguous(),
                            loss_mask=loss_mask))
    return batches


def masked_loss_func(loss_mask, output_tensor):
    """Megatron's 2-tuple loss contract: the masked mean of the per-token losses, and its report."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def stage_layer_key(key: str, layer_offset: int) -> str:
    """Map a stage model's state-dict key to the full (pp=1) model's key.

    Stage models number their layers from 0: a stage holding global layers [o, o+n) has
    `decoder.layers.i.*` for global layer `o + i` (`TransformerLayer.layer_number` is 1-based and
    global; the module index is local).
    """
    prefix = "decoder.layers."
    if key.startswith(prefix):
        index, rest = key[len(prefix) :].split(".", 1)
        return f"{prefix}{int(index) + layer_offset}.{rest}"
    return key


def full_key(key: str, layer_offset: int, full_keys) -> str:
    name = stage_layer_key(key, layer_offset)
    if name == _OUTPUT_WEIGHT and name not in full_keys and _EMBEDDING_WEIGHT in full_keys:
        # Tied embeddings: the last stage's output_layer.weight is the full model's embedding.
        return _EMBEDDING_WEIGHT
    return name


_OUTPUT_WEIGHT = "output_layer.weight"
_EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"


def layer_offset(stage_model) -> int:
    layers = stage_model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def load_stage_from_full(stage_model, full_state_dict: Dict[str, torch.Tensor]) -> None:
    """Copy the matching tensors of a full (pp=1) model's state dict into a stage model.

    Layer keys are shifted by the stage's layer offset; with tied embeddings the last stage's
    `output_layer.weight` takes the full model's `embedding.word_embeddings.weight`.
    """
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


def stage_grads_as_full(stage_model, full_keys) -> Dict[str, torch.Tensor]:
    """The stage's parameter gradients keyed by the full model's parameter names.

    `full_keys` is the full model's key set (needed for the tied-embedding mapping); a tied
    embedding's gradient then appears under the same key on the first and the last stage, and
    the full model's gradient is their sum.
    """
    offset = layer_offset(stage_model)
    return {
        full_key(name, offset, full_keys): param.grad.detach().clone()
        for name, param in stage_model.named_parameters()
        if param.grad is not None
    }



"""The tiny megatron-core GPT of the tests, the selftest and the main job: config, model, seeds."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch


def seed_all(seed: int) -> None:
    """Seed torch's default generator and megatron's model-parallel RNG tracker."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def tiny_gpt_config(*, num_layers: int = 4, hidden_size: int = 32, num_attention_heads: int = 4,
                    num_moe_experts: Optional[int] = None, **overrides: Any):
    """A small float32 `TransformerConfig`, dropout off, CPU initialization, no fusions; with
    `num_moe_experts` an MoE config (SequentialMLP experts, top-2 allgather router, no aux loss);
    with ``multi_latent_attention=True`` megatron-core's `MLATransformerConfig`."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    kwargs: Dict[str, Any] = dict(
        num_layers=num_layers, hidden_size=hidden_size, ffn_hidden_size=4 * hidden_size,
        num_attention_heads=num_attention_heads, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, init_method_std=0.02)
    if ps.model_parallel_is_initialized():
        kwargs.update(tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                      pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                      expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
    if num_moe_experts is not None:
        # no linear biases: SequentialMLP experts with biases fail in megatron-core 0.16.1 on any device
        # (``output += output_bias * per_token_scale`` modifies a view autograd returned in place)
        kwargs.update(num_moe_experts=num_moe_experts, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                      moe_grouped_gemm=False, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                      moe_ffn_hidden_size=2 * hidden_size, add_bias_linear=False)
    kwargs.update(overrides)
    return (MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig)(**kwargs)


def build_tiny_gpt(config, *, vocab_size: int = 64, max_sequence_length: int = 16, pre_process: Optional[bool] = None,
                   post_process: Optional[bool] = None, share_embeddings_and_output_weights: bool = False,
                   layer_spec: str = "local", **kwargs: Any):
    """`GPTModel` with the local layer spec (``layer_spec="te"``: Transformer Engine's); a config with
    multi-latent attention or dense and MoE layers mixed (DeepSeek-V3) gets megatron-core's decoder
    block spec and one with ``mtp_num_layers`` its MTP block, as ``pretrain_gpt.py`` builds them."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec,
                                                          get_gpt_mtp_block_spec)

    pre_process = ps.is_pipeline_first_stage() if pre_process is None else pre_process
    post_process = ps.is_pipeline_last_stage() if post_process is None else post_process
    if layer_spec not in ("local", "te"):
        raise ValueError(f"layer_spec must be 'local' or 'te', got {layer_spec!r}")
    te = layer_spec == "te"
    if getattr(config, "multi_latent_attention", False) or isinstance(config.moe_layer_freq, list):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=config.normalization,
                                          vp_stage=kwargs.get("vp_stage"))
    else:
        layers = get_gpt_layer_with_transformer_engine_spec if te else get_gpt_layer_local_spec
        spec = layers(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    if getattr(config, "mtp_num_layers", None):
        kwargs["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=te,
                                                          vp_stage=kwargs.get("vp_stage"))
    return GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=share_embeddings_and_output_weights, **kwargs)

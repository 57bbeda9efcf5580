"""Single-machine megatron-core environment for tests: gloo process group, model-parallel groups,
seeds, a tiny GPT model, and :func:`run_workers` with megatron-core preloaded in the workers.

Typical multi-process test::

    def worker(rank, world_size, port, result_queue):
        init_distributed_cpu(rank, world_size, port, pp=world_size)
        try:
            ...
        finally:
            destroy_distributed()

    run_workers(worker, world_size=2)

`init_distributed_cpu` calls `megatron_dualpipe.cpu.enable()`, which does nothing on a GPU machine.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dualpipe import cpu as cpu_mode

from . import workers
from .workers import free_port, to_numpy  # noqa: F401  (tests reach them through this module)

#: What the workers of megatron-core tests import before forking (once per forkserver).
MEGATRON_PRELOAD = workers.TORCH_PRELOAD + (
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel",
    "megatron.core.distributed",
)


def run_workers(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 120.0,
                **kwargs: Any) -> List[Any]:
    """:func:`harness.workers.run_workers` with megatron-core preloaded in the worker processes."""
    kwargs.setdefault("preimport", MEGATRON_PRELOAD)
    return workers.run_workers(fn, world_size, args=args, timeout=timeout, **kwargs)


def init_distributed_cpu(
    rank: int,
    world_size: int,
    port: int,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    vpp: Optional[int] = None,
    seed: int = 1234,
    timeout_minutes: int = 2,
) -> None:
    """Start a gloo process group on 127.0.0.1:port, build megatron-core's parallel groups, seed.

    Seeds Python-side torch RNG with `seed` and the model-parallel RNG tracker with
    `model_parallel_cuda_manual_seed(seed)` (CPU tracker in CPU mode).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu = cpu_mode.enable()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import datetime

    dist.init_process_group(
        backend="gloo" if cpu else "nccl",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )
    if not cpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=False,
    )
    seed_all(seed)


def seed_all(seed: int) -> None:
    """Seed torch's default generator and megatron's model-parallel RNG tracker."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_distributed() -> None:
    """Undo `init_distributed_cpu`."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


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
    **kwargs: Any,
):
    """`GPTModel` with the local (no Transformer Engine) layer spec.

    `pre_process` / `post_process` default to the stage predicates of `parallel_state`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm
    )
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


def _full_key(key: str, layer_offset: int, full_keys) -> str:
    full_key = stage_layer_key(key, layer_offset)
    if full_key == _OUTPUT_WEIGHT and full_key not in full_keys and _EMBEDDING_WEIGHT in full_keys:
        # Tied embeddings: the last stage's output_layer.weight is the full model's embedding.
        return _EMBEDDING_WEIGHT
    return full_key


_OUTPUT_WEIGHT = "output_layer.weight"
_EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"


def _layer_offset(stage_model) -> int:
    layers = stage_model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def load_stage_from_full(stage_model, full_state_dict: Dict[str, torch.Tensor]) -> None:
    """Copy the matching tensors of a full (pp=1) model's state dict into a stage model.

    Layer keys are shifted by the stage's layer offset; with tied embeddings the last stage's
    `output_layer.weight` takes the full model's `embedding.word_embeddings.weight`.
    """
    offset = _layer_offset(stage_model)
    missing = []
    with torch.no_grad():
        for key, tensor in stage_model.state_dict().items():
            if key.endswith("_extra_state"):
                continue
            full_key = _full_key(key, offset, full_state_dict)
            if full_key not in full_state_dict:
                missing.append(full_key)
                continue
            tensor.copy_(full_state_dict[full_key])
    if missing:
        raise KeyError(f"keys missing from the full model: {missing}")


def stage_grads_as_full(stage_model, full_keys) -> Dict[str, torch.Tensor]:
    """The stage's parameter gradients keyed by the full model's parameter names.

    `full_keys` is the full model's key set (needed for the tied-embedding mapping); a tied
    embedding's gradient then appears under the same key on the first and the last stage, and
    the full model's gradient is their sum.
    """
    offset = _layer_offset(stage_model)
    return {
        _full_key(name, offset, full_keys): param.grad.detach().clone()
        for name, param in stage_model.named_parameters()
        if param.grad is not None
    }



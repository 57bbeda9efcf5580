"""The tiny GPT (or MoE GPT) under Megatron's 1F1B, DualPipe and DualPipeV, every one loaded from
the same full (pp=1) weights, and one iteration of each: what the tests and the selftest run.
The full weights are built on every rank from one seed (no state dict moves between ranks); the
gradients are keyed by the full model's names (:mod:`.names`), so every schedule's compare by name.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import names, tiny_gpt
from .data import forward_step, make_gpt_batches
from .reference import weights
from ..schedule import registry
from ..schedule.layout import BIDIRECTIONAL, V_SHAPE
from ..schedule.registry import DUALPIPE, DUALPIPEV, INTERLEAVED_1F1B, ONE_F_ONE_B

SEED = 1234
SCHEDULES = (ONE_F_ONE_B, DUALPIPE, DUALPIPEV)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What to build: sizes, dtype, layer implementation, MoE or dense, tied embeddings, and any
    other ``TransformerConfig`` field (``config``: (name, value) pairs, applied last)."""

    layers: int
    hidden: int = 32
    heads: int = 4
    seq: int = 16
    mbs: int = 2
    vocab: int = 64
    dtype: str = "fp32"  # fp32 | bf16
    layer_spec: str = "local"  # local | te
    experts: Optional[int] = None  # MoE with this many experts (alltoall dispatcher)
    combined_step: bool = False  # fused F&B units through megatron-core's combined step (MoE, EP > 1)
    #: zero bubble through Transformer Engine: the executor's chunks defer TE's weight gradients to W
    #: (``delay_wgrad_compute``; Megatron's 1F1B cannot take it)
    te_deferral: bool = False
    fp8: bool = False
    tied: bool = False
    config: Tuple[Tuple[str, Any], ...] = ()
    model: Tuple[Tuple[str, Any], ...] = ()  # GPTModel arguments (position embedding, rotary settings)

    @property
    def torch_dtype(self):
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]

    def label(self) -> str:
        kind = f"MoE GPT ({self.experts} experts, alltoall)" if self.experts else "GPT"
        arch = ", RoPE + SwiGLU + RMSNorm" if dict(self.model).get("position_embedding_type") == "rope" else ""
        if dict(self.config).get("multi_latent_attention"):
            kind, arch = f"DeepSeek-V3-shaped MoE GPT ({self.experts} experts, alltoall)", f", {V3_LABEL}"
        return (f"{kind}{arch}, {self.layers} layers, hidden {self.hidden}, seq {self.seq}, micro-batch {self.mbs}, "
                f"{self.dtype}{' fp8' if self.fp8 else ''}, {self.layer_spec} layers")

    def batches(self, n: int, seed: int = 7, short=()) -> List[dict]:
        """``n`` micro-batches of this model's shape (:func:`.data.make_gpt_batches`), on the CPU."""
        return make_gpt_batches(n, vocab=self.vocab, seq=self.seq, mbs=self.mbs, seed=seed, short=short)


SWIGLU_RMSNORM = (("gated_linear_unit", True), ("activation_func", torch.nn.functional.silu),
                  ("normalization", "RMSNorm"))


def users_architecture(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the architecture users train (every shipped config, Llama and DeepSeek alike)
    instead of GPT-2's: rotary positions (base 500000 on half of each head, Llama 3.1's frequency
    scaling), SwiGLU, RMSNorm, untied output weights."""
    model = (("position_embedding_type", "rope"), ("rotary_base", 500000), ("rotary_percent", 0.5),
             ("rope_scaling", True), ("rope_scaling_factor", 8.0))
    return dataclasses.replace(spec, tied=False, config=spec.config + SWIGLU_RMSNORM, model=spec.model + model)


V3_LABEL = ("MLA + YaRN, SwiGLU, RMSNorm, untied; layer 1 dense; sigmoid routing with expert bias, top-2 "
            "in 2 groups (1 picked), scaled 2.5, one shared expert, no aux loss")


def deepseek_v3(spec: ModelSpec) -> ModelSpec:
    """``spec`` (MoE, an even number of experts) shaped as DeepSeek-V3 at tiny sizes (:data:`V3_LABEL`:
    configs/moe_deepseek_v3_cpu.sh's recipe without its auxiliary loss). The expert bias moves only in
    Megatron's finalize step, not inside one iteration."""
    if not spec.experts or spec.experts % 2:
        raise ValueError(f"the V3 model routes in 2 groups: it needs an even number of experts, got {spec.experts}")
    moe = (("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True),
           ("moe_router_num_groups", 2), ("moe_router_group_topk", 1), ("moe_router_topk_scaling_factor", 2.5),
           ("moe_shared_expert_intermediate_size", spec.hidden), ("moe_layer_freq", [0] + [1] * (spec.layers - 1)))
    mla = multi_latent(spec)
    return dataclasses.replace(mla, config=mla.config + SWIGLU_RMSNORM + moe)


def multi_latent(spec: ModelSpec) -> ModelSpec:
    """``spec`` with DeepSeek-V3's multi-latent attention (low-rank q and kv, decoupled RoPE, YaRN), untied."""
    head = spec.hidden // spec.heads
    mla = (("multi_latent_attention", True), ("q_lora_rank", spec.hidden), ("kv_lora_rank", spec.hidden // 2),
           ("qk_head_dim", head), ("qk_pos_emb_head_dim", head // 2), ("v_head_dim", head), ("rope_type", "yarn"),
           ("rotary_scaling_factor", 40.0), ("mscale", 1.0), ("mscale_all_dim", 1.0))
    return dataclasses.replace(spec, tied=False, config=spec.config + mla,
                               model=spec.model + (("position_embedding_type", "rope"),))


def config_of(spec: ModelSpec, *, full: bool = False, executor: bool = False):
    """The ``TransformerConfig`` (``full``: the pp=1 model's; ``executor``: with the combined step and TE's
    weight-gradient deferral on where the spec asks, as Megatron's 1F1B runs neither)."""
    # On a GPU the parameters are made on the device (as Megatron does): the chunks' constructors
    # and the mirror broadcast then run on NCCL with CUDA tensors.
    overrides = dict(params_dtype=spec.torch_dtype, pipeline_dtype=spec.torch_dtype,
                     bf16=spec.dtype == "bf16", use_cpu_initialization=not torch.cuda.is_available())
    if full:
        overrides["pipeline_model_parallel_size"] = 1
    if spec.fp8:
        overrides.update(fp8="hybrid", fp8_recipe="tensorwise")  # delayed scaling is refused under dualpipe
    if spec.experts:
        overrides.update(num_moe_experts=spec.experts, moe_token_dispatcher_type="alltoall")
    else:  # a dense model next to expert parallelism: its data-parallel replicas are just that
        overrides["expert_model_parallel_size"] = 1
    overrides.update(spec.config)
    config = tiny_gpt.tiny_gpt_config(num_layers=spec.layers, hidden_size=spec.hidden,
                                      num_attention_heads=spec.heads, **overrides)
    if executor and (spec.combined_step or spec.te_deferral):
        from ..mcore.overlap import enable_combined_step, enable_deferred_wgrads

        if spec.combined_step:
            enable_combined_step(config, delay_wgrad_compute=spec.te_deferral)
        else:
            enable_deferred_wgrads(config)
    return config


def _build(spec: ModelSpec, config, **kwargs):
    return tiny_gpt.build_tiny_gpt(config, vocab_size=spec.vocab, max_sequence_length=spec.seq,
                                   share_embeddings_and_output_weights=spec.tied, layer_spec=spec.layer_spec,
                                   **dict(spec.model), **kwargs)


def full_model(spec: ModelSpec):
    """The pp=1 model (this rank's tensor/expert shards), the same weights on every pipeline rank:
    the source of every schedule's weights and the reference (:mod:`.reference`)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from .. import hooks

    tiny_gpt.seed_all(SEED)
    pgc = copy.copy(ProcessGroupCollection.use_mpu_process_groups())
    pgc.pp = pgc.embd = None  # a one-stage pipeline
    # megatron-core asks parallel_state whether this is the last stage, where MTP layers are built
    one_stage = (hooks.entry("scoped", name).to(lambda *a, **k: True)
                 for name in ("is_pipeline_first_stage", "is_pipeline_last_stage"))
    with hooks.scoped(*one_stage):
        return _build(spec, config_of(spec, full=True), pre_process=True, post_process=True, pg_collection=pgc)


def full_state_dict(spec: ModelSpec) -> Dict[str, torch.Tensor]:
    """:func:`full_model`'s weights."""
    return weights(full_model(spec))


def provider(spec: ModelSpec, v_layout: bool = False, executor: bool = False):
    """``model_provider`` for ``build_two_direction_model`` (and, called plainly, 1F1B's stage)."""
    from ..mcore.model import dualpipev_config

    def build(pre_process=None, post_process=None, pg_collection=None, vp_stage=None):
        config = config_of(spec, executor=executor)
        if v_layout:
            config = dualpipev_config(config)
        return _build(spec, config, pre_process=pre_process, post_process=post_process,
                      pg_collection=pg_collection, vp_stage=vp_stage)

    return build


def batches(spec: ModelSpec, m: int, step: int = 0) -> List[dict]:
    """This data-parallel replica's ``m`` micro-batches of optimizer step ``step`` (on the device)."""
    from megatron.core import parallel_state as ps

    seed = 7 + 1000 * step + ps.get_data_parallel_rank()
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return [{k: v.to(device) for k, v in b.items()} for b in spec.batches(m, seed)]


def _interleaved(spec: ModelSpec) -> List[torch.nn.Module]:
    """Interleaved 1F1B's two chunks on this rank (virtual stages ``r`` and ``pp + r``), as
    ``pretrain_gpt.py`` builds them: one config with ``virtual_pipeline_model_parallel_size=2`` and
    Megatron-LM's default with it, ``--overlap-p2p-communication`` (unbatched sends: batched ones
    with pp=2, where the previous and the next rank are one peer, pair a gradient with an activation
    on gloo; Megatron-LM refuses them for pp <= 2). The combined step's flag is set after
    megatron-core's checks (:func:`..mcore.overlap.enable_combined_step`): its bf16/fp16 assertion
    would refuse the fp32 proof; the fp32 path differs only by the loss cast, the identity there."""
    from megatron.core import parallel_state as ps

    config = dataclasses.replace(config_of(spec), virtual_pipeline_model_parallel_size=2, overlap_p2p_comm=True,
                                 batch_p2p_comm=False)
    if spec.combined_step:
        from ..mcore.overlap import enable_combined_step

        enable_combined_step(config)
    rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    return [_build(spec, config, pre_process=v == 0 and rank == 0, post_process=v == 1 and rank == pp - 1,
                   vp_stage=v) for v in range(2)]


def build(spec: ModelSpec, schedule: str, full: Dict[str, torch.Tensor]) -> List[torch.nn.Module]:
    """The chunks ``schedule`` runs on this rank, loaded from ``full`` (DualPipe's mirrors broadcast
    from their partners); with ``te_deferral`` in megatron DDP (:func:`_in_ddp`)."""
    from ..mcore.model import broadcast_mirrors, build_two_direction_model

    kind = registry.get(schedule).layout_kind if schedule in registry.NAMES else None
    if schedule == INTERLEAVED_1F1B:
        chunks = _interleaved(spec)
    elif schedule == ONE_F_ONE_B:
        chunks = [provider(spec)()]
    elif kind in (BIDIRECTIONAL, V_SHAPE):
        chunks = list(build_two_direction_model(provider(spec, v_layout=kind == V_SHAPE, executor=True),
                                                layout_kind=kind))
    else:
        known = ", ".join(SCHEDULES + (INTERLEAVED_1F1B,))
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {known}")
    for chunk in chunks[:1] if kind == BIDIRECTIONAL else chunks:  # DualPipe's mirrors: broadcast below
        names.load_stage_from_full(chunk, full)
    if kind == BIDIRECTIONAL:
        broadcast_mirrors(chunks)
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = None  # plain modules: no data-parallel reduction
    return _in_ddp(chunks) if spec.te_deferral else chunks


def _in_ddp(chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """Each chunk in megatron DDP (one unbucketed buffer, nothing reduced: finalize is off), its
    ``delay_wgrad_compute`` the chunk's: TE's ``backward_dw`` assigns each weight gradient to
    ``param.grad``, and only DDP's hooks on the deferring modules add it to ``main_grad``, as
    Megatron-LM's training sets them up (without them every micro-batch's would replace the last)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    # gradients accumulated in fp32, as Megatron-LM's --bf16 sets (--accumulate-allreduce-grads-in-fp32)
    ddp_config = DistributedDataParallelConfig(delay_wgrad_compute=bool(chunks[0].config.delay_wgrad_compute),
                                               grad_reduce_in_fp32=True)
    return [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=True) for chunk in chunks]


def run_iteration(spec: ModelSpec, schedule: str, chunks: Sequence[torch.nn.Module], micro_batches: List[dict],
                  *, p2p_timeout: float, forward_only: bool = False,
                  forward_step_func=forward_step) -> Optional[List[float]]:
    """One ``forward_backward_func`` call; the losses on the last pipeline rank (None elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    kwargs = dict(forward_step_func=forward_step_func, data_iterator=iter(micro_batches), model=list(chunks),
                  num_microbatches=len(micro_batches), seq_length=spec.seq, micro_batch_size=spec.mbs,
                  forward_only=forward_only)
    if schedule == ONE_F_ONE_B:
        out = schedules.get_forward_backward_func()(**kwargs)
    elif schedule == INTERLEAVED_1F1B:  # one iterator per chunk, each over all the micro-batches
        from .. import hooks

        kwargs["data_iterator"] = [iter(micro_batches) for _ in chunks]
        # parallel_state says two virtual stages, as Megatron's initialize_model_parallel does with
        # a virtual pipeline: the combined step asks it where the loss is taken
        with hooks.scoped(hooks.entry("scoped", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE").to(2)):
            out = schedules.forward_backward_pipelining_with_interleaving(**kwargs)
    else:
        from ..mcore.forward_backward import forward_backward_dualpipe

        out = forward_backward_dualpipe(schedule=schedule, p2p_timeout=p2p_timeout, **kwargs)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return [float(d["lm loss"]) for d in out]


#: The key of a last stage's copy of the word embedding (MTP's, or the tied output weight): until
#: Megatron's finalize sums the copies each holds its own stage's part, compared with 1F1B's copy.
LAST_STAGE_EMBEDDING = "embedding.word_embeddings.weight (the last stage's copy)"


def grads_by_full_name(chunks: Sequence[torch.nn.Module], full_keys) -> List[Dict[str, Any]]:
    """Per chunk: gradient as a float64 numpy array under the full model's parameter name (the last
    stage's copy of the word embedding under :data:`LAST_STAGE_EMBEDDING`)."""
    from ..mcore.model import embedding_copy

    def grad(p):  # DDP's main_grad where the chunk is wrapped
        g = names.grad_of(p)
        return None if g is None else g.double().cpu().numpy()

    out = []
    for chunk in chunks:
        found = embedding_copy(chunk)
        copy = found[1] if found is not None and found[0] == "output" else None
        grads = names.by_full_name(chunk, full_keys, lambda p: None if p is copy else grad(p))
        if copy is not None and copy.grad is not None:
            grads[LAST_STAGE_EMBEDDING] = grad(copy)
        out.append(grads)
    return out


def zero_grads(chunks: Sequence[torch.nn.Module]) -> None:
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
        if hasattr(chunk, "zero_grad_buffer"):  # megatron DDP: main_grad
            chunk.zero_grad_buffer()

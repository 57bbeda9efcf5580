"""The activation model (``costs/activation_memory.py``) against what autograd keeps in real
megatron-core layers: one bf16 layer of the local spec per case, one forward of an [s, b, h] input
in the CPU mode, every tensor saved for the backward collected with ``saved_tensors_hooks``.

Measured: the bytes of the distinct storages those tensors hold once the forward is done (the
``CheckpointWithoutOutput`` of layernorm, mla_up_proj and moe_act has freed its outputs by then),
parameters excluded, per token. The layer's input counts: the model lists it as the input norm's input.

Where the local spec on a CPU differs from a GPU run, the cases take the GPU's side:

* core attention: the local unfused attention keeps s x s scores; the model assumes none (flash
  attention, or core_attn recomputed). Every case recomputes core_attn, Megatron's default for
  ``--recompute-granularity selective``.
* dropout (0.1, Megatron's default, hidden and attention): ``F.dropout`` on a CPU keeps a bf16
  noise tensor, CUDA's fused ``native_dropout`` a one-byte mask (the model's): the layers run with
  ``torch.native_dropout``.
* normalization: LayerNorm; torch's RMSNorm on a CPU is composite and keeps fp32 copies that TE's
  and Apex's fused kernels do not.
* moe_act needs grouped GEMM: the local spec's legacy GroupedMLP (on the grouped_gemm stand-in)
  with TEGroupedMLP's fused activation (``weighted_bias_swiglu_impl``, --bias-swiglu-fusion);
  GroupedMLP's own unfused SwiGLU keeps two more k x moe-ffn tensors.

Not measurable here: FP8 (TE), tensor and sequence parallelism (one process). RoPE's new query and
key: the last two tests.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import gc
import weakref
from typing import Dict, Tuple

import pytest
import torch
import torch.nn.functional as F

from harness import megatron_env as me
from megatron_dualpipe.costs import activation_memory as am
from megatron_dualpipe.costs.model_args import parse

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")

S, B, H = 32, 2, 256
#: The model lists tensors, not the small ones (norm statistics, router probabilities and indices,
#: RoPE's cos/sin: under 1% of these layers): measured may exceed it by TOL, which stays below its
#: smallest whole-width entry (a one-byte dropout mask, h: 2.5-3.3% of these layers), never fall short.
TOL = 0.02
BASE_ARGV = ("--num-layers", "1", "--hidden-size", str(H), "--seq-length", str(S), "--micro-batch-size", str(B),
             "--vocab-size", "128", "--recompute-granularity", "selective")
#: Megatron-LM's defaults where they run on a CPU; the fusions that need CUDA or TE off.
COMMON = dict(num_layers=1, hidden_size=H, use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
              pipeline_dtype=torch.bfloat16, hidden_dropout=0.1, attention_dropout=0.1, bias_activation_fusion=True,
              bias_dropout_fusion=True, masked_softmax_fusion=False, apply_rope_fusion=False,
              gradient_accumulation_fusion=False, persist_layer_norm=False, normalization="LayerNorm",
              recompute_granularity="selective")
SWIGLU = dict(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer: its TransformerConfig fields, local-spec arguments and pretrain_gpt.py flags."""

    config: Tuple[Tuple[str, object], ...]
    argv: Tuple[str, ...]
    spec: Tuple[Tuple[str, object], ...] = ()
    moe: bool = False
    recompute: Tuple[str, ...] = ()  # besides core_attn
    rope: bool = False
    fused_grouped_act: bool = False

    def model_bytes(self) -> float:
        return am.layer_bytes(self.model_args(), self.moe)

    def model_args(self):
        rope = ("--position-embedding-type", "rope") if self.rope else ()
        return parse(BASE_ARGV + self.argv + rope + ("--recompute-modules", "core_attn") + self.recompute)


_MOE = dict(num_attention_heads=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
            moe_shared_expert_intermediate_size=256, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
            moe_router_load_balancing_type="none", **SWIGLU)
_MOE_ARGV = ("--num-attention-heads", "4", "--swiglu", "--num-experts", "4", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "128", "--moe-shared-expert-intermediate-size", "256")
LAYERS: Dict[str, Case] = {
    "dense MHA GELU": Case((("num_attention_heads", 4),), ("--num-attention-heads", "4")),
    "dense GQA SwiGLU": Case(tuple(dict(num_attention_heads=8, num_query_groups=2, ffn_hidden_size=768,
                                        **SWIGLU).items()),
                             ("--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
                              "--swiglu", "--ffn-hidden-size", "768")),
    "MLA SwiGLU": Case(tuple(dict(num_attention_heads=8, ffn_hidden_size=768, multi_latent_attention=True,
                                  q_lora_rank=96, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16,
                                  v_head_dim=32, qk_layernorm=True, **SWIGLU).items()),  # the latents' norms (0.19 checks)
                       ("--num-attention-heads", "8", "--swiglu", "--ffn-hidden-size", "768",
                        "--multi-latent-attention", "--q-lora-rank", "96", "--kv-lora-rank", "64",
                        "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32"),
                       spec=(("multi_latent_attention", True), ("qk_layernorm", True))),
    "MoE 4 experts top-2 + shared": Case(tuple(_MOE.items()), _MOE_ARGV, spec=(("num_experts", 4),), moe=True),
    "MoE grouped GEMM": Case(tuple(dict(_MOE, moe_grouped_gemm=True).items()), _MOE_ARGV,
                             spec=(("num_experts", 4), ("moe_grouped_gemm", True)), moe=True, fused_grouped_act=True),
}
#: Each recompute module on the layers megatron-core 0.16.1 applies it to.
RECOMPUTE = {"layernorm": ("dense MHA GELU", "MoE 4 experts top-2 + shared"), "mla_up_proj": ("MLA SwiGLU",),
             "mlp": ("dense GQA SwiGLU",), "moe_act": ("MoE grouped GEMM",), "moe": ("MoE 4 experts top-2 + shared",),
             "shared_experts": ("MoE 4 experts top-2 + shared",)}
ROPE = "dense MHA GELU with RoPE"
if tuple(int(x) for x in importlib.metadata.version("megatron-core").split(".")[:2]) >= (0, 19):
    # 0.19's local spec builds SequentialMLP for grouped GEMM (the legacy GroupedMLP is gone; TEGroupedMLP is the
    # TE spec's), so the grouped case and moe_act, which needs it, are measured at 0.16.1 only
    LAYERS = {k: v for k, v in LAYERS.items() if k != "MoE grouped GEMM"}
    RECOMPUTE = {k: v for k, v in RECOMPUTE.items() if k != "moe_act"}
CASES: Dict[str, Case] = dict(LAYERS)
CASES.update({f"{base} + {module}": dataclasses.replace(LAYERS[base], recompute=(module,))
              for module, bases in RECOMPUTE.items() for base in bases})
CASES[ROPE] = dataclasses.replace(LAYERS["dense MHA GELU"], rope=True)


@contextlib.contextmanager
def _gpu_dropout():
    """``F.dropout`` as CUDA runs it (``native_dropout``: a one-byte mask kept, not a bf16 noise tensor)."""
    plain = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1:
            return torch.native_dropout(input, p, True)[0]
        return plain(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = plain


def _build(case: Case):
    """The case's one-layer TransformerLayer (local spec), seeded, in training mode."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    fields = dict(COMMON, **dict(case.config), recompute_modules=["core_attn", *case.recompute])
    config = (MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig)(**fields)
    torch.manual_seed(7)
    layer = build_module(get_gpt_layer_local_spec(**dict(case.spec)), config=config, layer_number=1)
    if case.fused_grouped_act:  # TEGroupedMLP's activation with --bias-swiglu-fusion
        from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

        experts = layer.mlp.experts
        assert hasattr(experts, "activation_func_with_probs"), type(experts)
        experts.activation_func_with_probs = lambda x, probs: weighted_bias_swiglu_impl(x, None, probs, False)
    return layer.train()


def _measure(case: Case) -> dict:
    """Bytes per token of the distinct storages the layer's autograd graph keeps after one forward."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    layer = _build(case)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    rope = RotaryEmbedding(layer.config.kv_channels, rotary_percent=1.0)(S) if case.rope else None
    refs = []

    def pack(t):
        refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
    gc.collect()
    storages, input_bytes = {}, 0
    for ref in refs:
        t = ref()
        if t is None:  # saved by a node the output does not reach
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() == x.untyped_storage().data_ptr():
            input_bytes = storage.nbytes()
        elif storage.data_ptr() not in params:
            storages.setdefault(storage.data_ptr(), (storage.nbytes(), tuple(t.shape), str(t.dtype)))
    del out
    listing = sorted(((n / (S * B), shape, dtype) for n, shape, dtype in storages.values()), reverse=True)
    return {"per_token": (sum(n for n, _, _ in storages.values()) + input_bytes) / (S * B),
            "input": input_bytes / (S * B), "tensors": listing}


def _measure_worker(rank, world, port, names):
    """A fresh process (spawned: megatron-core not imported yet) in the CPU mode with its stand-ins
    for the GPU libraries: megatron-core 0.16.1's CheckpointWithoutOutput (the layernorm, mla_up_proj
    and moe_act recompute) calls Transformer Engine's FP8GlobalStateManager even without FP8 (its
    ``fp8 is not None`` is true for False), a NameError where TE is absent; moe_act needs grouped_gemm."""
    from megatron_dualpipe import cpu

    assert cpu.enable()
    me.init_distributed_cpu(rank, world, port)
    from megatron.core.tensor_parallel import random as mc_random

    assert mc_random.HAVE_TE, "megatron-core was imported before the CPU mode's stand-ins"
    try:
        with _gpu_dropout():
            return {name: _measure(CASES[name]) for name in names}
    finally:
        me.destroy_distributed()


@pytest.fixture(scope="module")
def measured():
    [got] = me.run_workers(_measure_worker, 1, args=(tuple(CASES),), timeout=240, start_method="spawn", preimport=())
    return got


def _explain(name, got):
    """The saved tensors of a case beside the model's list, to find the one the model gets wrong."""
    case = CASES[name]
    lines = [f"  saved: {got['input']:8.1f} B/token  the layer's input"]
    lines += [f"  saved: {n:8.1f} B/token  {shape} {dtype}" for n, shape, dtype in got["tensors"]]
    m = case.model_args()
    lines += [f"  model: {t.bytes:8.1f} B/token  {t.what}" for t in am.layer_tensors(m, case.moe)
              if not set(t.freed_by) & set(m.recompute_modules)]
    return "\n".join([name] + lines)


def _row(name, got):
    modelled = CASES[name].model_bytes()
    ratio = got["per_token"] / modelled
    print(f"{name:46s} {got['per_token']:10.1f} {modelled:10.1f} {ratio:7.4f} {got['input']:7.0f}")
    return ratio


def test_each_layer_keeps_what_the_model_lists(measured):
    """Every case, measured per token against ``layer_bytes``: the listed tensors all kept, the
    unlisted small ones under TOL."""
    print(f"\n{'case (core_attn recomputed)':46s} {'measured':>10s} {'modelled':>10s} {'ratio':>7s} {'input':>7s}"
          "   (bytes per token)")
    off = []
    for name in CASES:
        if name != ROPE and not 1 <= _row(name, measured[name]) <= 1 + TOL:
            off.append(name)
    for name in off:
        print(_explain(name, measured[name]))
    assert not off, f"outside [1, 1 + {TOL}]: {off}"


def test_each_recompute_module_frees_what_the_model_says(measured):
    """Each --recompute-modules entry: the measured saving against the model's (its tensors), on
    every layer type it applies to."""
    print(f"\n{'module':15s} {'layer':30s} {'measured saving':>16s} {'modelled saving':>16s}  (bytes per token)")
    off = []
    for module, bases in RECOMPUTE.items():
        for base in bases:
            name = f"{base} + {module}"
            got = measured[base]["per_token"] - measured[name]["per_token"]
            want = CASES[base].model_bytes() - CASES[name].model_bytes()
            print(f"{module:15s} {base:30s} {got:16.1f} {want:16.1f}")
            if not (want > 0 and want <= got <= want + TOL * CASES[base].model_bytes()):
                off.append(name)
    for name in off:
        print(_explain(name, measured[name]))
    assert not off, off


def test_rope_keeps_copies_of_query_and_key(measured):
    """What the model misses with RoPE: a query and a key more (q + kv = 2h here, 2 bytes each), and
    RoPE's cos and sin for each (per position, shared by the batch)."""
    got, plain = measured[ROPE]["per_token"], measured["dense MHA GELU"]["per_token"]
    copies, cos_sin = 2 * 2 * H, 4 * 2 * (H // 4) / B
    print(f"\n{ROPE}: {got:.1f} B/token, without RoPE {plain:.1f}: +{got - plain:.1f} (query and key copies "
          f"{copies}, cos and sin {cos_sin:.0f})")
    assert copies <= got - plain <= copies + cos_sin


def test_the_model_counts_ropes_copies(measured):
    """The model's RoPE entries (a new key, and a new query without GQA) against what autograd keeps,
    less RoPE's cos and sin: one tensor per micro-batch that every layer shares, not a layer's."""
    got, modelled = measured[ROPE]["per_token"], CASES[ROPE].model_bytes()
    cos_sin = 4 * 2 * (H // 4) / B
    print(f"\n{ROPE}: measured {got:.1f} (cos and sin {cos_sin:.0f} of it), modelled {modelled:.1f}, "
          f"ratio {(got - cos_sin) / modelled:.4f}")
    assert 1 <= (got - cos_sin) / modelled <= 1 + TOL

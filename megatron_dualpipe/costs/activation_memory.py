"""What one micro-batch's activations take on one rank of a pipeline stage, tensor by tensor: Megatron's
``report_theoretical_memory`` has one formula for MHA with a GELU MLP, no term for MLA, SwiGLU, MoE, recomputed
modules, FP8 or MTP. ``tests/mcore/test_activation_memory_measured.py`` checks the list against what autograd saves.
Standard library only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from .model_args import ModelArgs

BF16 = 2
#: The term a rank keeps once, not per micro-batch in flight (the loss's backward follows it directly).
OUTPUT = "output layer and loss"


@dataclass(frozen=True)
class Saved:
    """One tensor a layer's backward keeps: bytes per token (bf16), the recompute modules that free
    it, whether a GEMM reads it (FP8 keeps one byte), whether TP splits it without sequence parallel."""

    what: str
    bytes: float
    freed_by: Tuple[str, ...] = ()
    gemm_input: bool = False
    tp_split: bool = True


def _attention(m: ModelArgs) -> List[Saved]:
    n = m.heads
    if not m.mla:
        q, kv = m.kv_channels * n, m.kv_channels * m.query_groups
        out = [Saved("query", BF16 * q), Saved("key", BF16 * kv), Saved("value", BF16 * kv)]
        if m.query_groups < n:
            # get_query_key_value_tensors: with GQA ``query.reshape`` copies the query out of the QKV
            # output, whose whole storage the key's and value's views keep for core attention
            out.append(Saved("query copy (GQA: reshaped out of the QKV output that key and value keep)", BF16 * q))
        if m.position_embedding == "rope":
            # apply_rotary_pos_emb returns a new key (and a new query; under GQA it replaces the copy above)
            out.append(Saved("key after RoPE", BF16 * kv))
            if m.query_groups == n:
                out.append(Saved("query after RoPE", BF16 * q))
        return out + [Saved("attention output (projection input)", BF16 * q, gemm_input=True)]
    qk, v, up = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim, ("mla_up_proj",)
    out = []
    if m.q_lora_rank is not None:
        out += [Saved("query down-projection (its norm's input)", BF16 * m.q_lora_rank),
                Saved("query latent (up-projection input)", BF16 * m.q_lora_rank, gemm_input=True)]
    out += [Saved("key-value down-projection (its norm's input)", BF16 * (m.kv_lora_rank + m.qk_pos_emb_head_dim)),
            Saved("key-value latent (up-projection input)", BF16 * m.kv_lora_rank, gemm_input=True),
            Saved("query after up-projection and RoPE", BF16 * n * qk, up),
            Saved("key after up-projection and RoPE", BF16 * n * qk, up),
            Saved("value after up-projection", BF16 * n * v, up),
            Saved("attention output (projection input)", BF16 * n * v, gemm_input=True)]
    return out


def _mlp(m: ModelArgs, moe: bool) -> List[Saved]:
    gate = 2 if m.swiglu else 1
    if not moe:
        f = m.ffn_hidden
        return [Saved("MLP fc1 output", BF16 * gate * f, ("mlp",)),
                Saved("MLP activation (fc2 input)", BF16 * f, ("mlp",), gemm_input=True)]
    k, fe, fs, h = m.topk, m.moe_ffn_hidden, m.shared_expert, m.hidden
    out = [Saved("tokens dispatched to experts (top-k copies)", BF16 * k * h, ("moe",), gemm_input=True),
           Saved("expert fc1 output", BF16 * k * gate * fe, ("moe",)),
           Saved("expert activation (fc2 input)", BF16 * k * fe, ("moe", "moe_act"), gemm_input=True)]
    # No expert output is kept: the experts apply the router's probabilities in their activation and
    # the combine's unpermute keeps only the token indices.
    if fs:
        out += [Saved("shared expert fc1 output", BF16 * gate * fs, ("moe", "shared_experts")),
                Saved("shared expert activation (fc2 input)", BF16 * fs, ("moe", "shared_experts"), gemm_input=True)]
    return out


def layer_tensors(m: ModelArgs, moe: bool) -> List[Saved]:
    """Everything one layer's backward keeps, per token, before TP and recomputation."""
    h = m.hidden
    norm = [Saved("input norm's input", BF16 * h, tp_split=False),
            Saved("input norm's output (QKV input)", BF16 * h, ("layernorm",), True, tp_split=False)]
    pre_mlp = [Saved("pre-MLP norm's input", BF16 * h, tp_split=False),
               Saved("pre-MLP norm's output (MLP input)", BF16 * h, ("layernorm",), True, tp_split=False)]
    masks = [Saved("attention dropout mask", h, tp_split=False), Saved("MLP dropout mask", h, tp_split=False)]
    return norm + _attention(m) + pre_mlp + _mlp(m, moe) + masks


#: ``--offload-modules`` -> the :func:`layer_tensors` entries whose copies move to host memory.
OFFLOADED = {"attn_norm": ("input norm's input",), "qkv_linear": ("input norm's output (QKV input)",),
             "attn_proj": ("attention output (projection input)",), "mlp_norm": ("pre-MLP norm's input",),
             "expert_fc1": ("tokens dispatched to experts (top-k copies)",), "moe_act": ("expert fc1 output",)}


def offloaded(m: ModelArgs, t: Saved) -> bool:
    """Whether ``--fine-grained-activation-offloading`` keeps ``t`` in host memory, not on the GPU."""
    mods = set(m.offload_modules) if m.offload else set()
    core_input = t.what in ("query", "key", "value") or t.what.startswith(("query copy", "query after", "key after",
                                                                             "value after"))
    return ("core_attn" in mods and core_input) or any(t.what in OFFLOADED.get(x, ()) for x in mods)


def layer_bytes(m: ModelArgs, moe: bool) -> float:
    """One layer's activations per token on one GPU, after recomputation, offloading, FP8 and TP."""
    if m.recompute == "full":
        return BF16 * m.hidden / (m.tp if m.sequence_parallel else 1)  # the layer's input only
    total = 0.0
    for t in layer_tensors(m, moe):
        if set(t.freed_by) & set(m.recompute_modules) or offloaded(m, t):
            continue
        size = t.bytes / 2 if (m.fp8 and t.gemm_input) else t.bytes
        total += size / m.tp if (t.tp_split or m.sequence_parallel) else size
    return total


def stage_terms(m: ModelArgs, moe_flags: Sequence[int], first: bool, last: bool) -> Dict[str, float]:
    """One micro-batch's activations on one rank of a stage with these layers, in bytes, by term."""
    tokens = m.seq_length / m.cp * m.micro_batch
    terms = {"layers": tokens * sum(layer_bytes(m, bool(moe)) for moe in moe_flags)}
    if first:
        terms["embedding"] = tokens * (8 + m.hidden)  # token ids and the embedding dropout (Megatron's)
    if last:
        if m.mtp_layers:
            terms["MTP layers"] = tokens * m.mtp_layers * (layer_bytes(m, bool(m.moe_pattern[-1]))
                                                           + 4 * BF16 * m.hidden / m.tp)
        # the output layer's input and fp32 logits per token (``4h(1 + V/h)``), per head and MTP depth
        terms[OUTPUT] = tokens * ((4 * m.hidden + 4 * m.padded_vocab) / m.tp * (1 + m.mtp_layers))
    return terms

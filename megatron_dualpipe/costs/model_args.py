"""A GPT model and its parallel layout, read from ``pretrain_gpt.py``'s arguments without Megatron's
parser (standard library only, like ``schedule``): Megatron-LM's defaults, the last occurrence
winning as with argparse, every argument that changes neither FLOPs nor memory ignored."""
from __future__ import annotations

import re
from dataclasses import make_dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule import registry
from ..schedule.stage_layout import LayoutError, decoder_counts
from ..schedule.stage_layout import parse as parse_layout


class ModelArgsError(ValueError):
    """An argument the model cannot be read from; the message names the flag and the fix."""


#: flag -> (attribute, type, Megatron-LM's default). ``None`` type: a switch.
_FLAGS: Dict[str, Tuple[str, Optional[type], object]] = {
    "--num-layers": ("num_layers", int, None),
    "--hidden-size": ("hidden", int, None),
    "--ffn-hidden-size": ("ffn_hidden", int, None),
    "--num-attention-heads": ("heads", int, None),
    "--num-query-groups": ("query_groups", int, None),
    "--kv-channels": ("kv_channels", int, None),
    "--seq-length": ("seq_length", int, None),
    "--micro-batch-size": ("micro_batch", int, 1),
    "--global-batch-size": ("global_batch", int, None),
    "--vocab-size": ("vocab_size", int, None),
    "--make-vocab-size-divisible-by": ("vocab_divisible_by", int, 128),
    "--num-experts": ("num_experts", int, None),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden", int, None),
    "--moe-router-topk": ("topk", int, 2),
    "--moe-shared-expert-intermediate-size": ("shared_expert", int, 0),
    "--moe-layer-freq": ("moe_layer_freq", str, "1"),
    "--q-lora-rank": ("q_lora_rank", int, None),
    "--kv-lora-rank": ("kv_lora_rank", int, 32),
    "--qk-head-dim": ("qk_head_dim", int, 128),
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", int, 64),
    "--v-head-dim": ("v_head_dim", int, 128),
    "--mtp-num-layers": ("mtp_layers", int, 0),
    "--tensor-model-parallel-size": ("tp", int, 1),
    "--pipeline-model-parallel-size": ("pp", int, 1),
    "--expert-model-parallel-size": ("ep", int, 1),
    "--expert-tensor-parallel-size": ("etp", int, None),
    "--context-parallel-size": ("cp", int, 1),
    "--num-layers-per-virtual-pipeline-stage": ("layers_per_virtual_stage", int, None),
    "--recompute-granularity": ("recompute", str, None),
    "--pipeline-schedule": ("schedule", str, registry.DEFAULT),
    "--normalization": ("normalization", str, "LayerNorm"),
    "--group-query-attention": ("gqa", None, False),
    "--swiglu": ("swiglu", None, False),
    "--untie-embeddings-and-output-weights": ("untie", None, False),
    "--multi-latent-attention": ("mla", None, False),
    "--sequence-parallel": ("sequence_parallel", None, False),
    "--use-distributed-optimizer": ("distributed_optimizer", None, False),
    "--overlap-grad-reduce": ("overlap_grad_reduce", None, False),
    "--decoder-first-pipeline-num-layers": ("first_stage_layers", int, None),
    "--decoder-last-pipeline-num-layers": ("last_stage_layers", int, None),
    "--pipeline-model-parallel-layout": ("layout", str, None),  # pp stages, or DualPipeV's 2*pp V-stages
    "--recompute-modules": ("recompute_modules", list, None),  # selective's (Megatron's default: core_attn)
    "--overlap-moe-expert-parallel-comm": ("a2a_overlap", None, False),  # fused F&B units hide the all-to-all
    "--fp8-format": ("fp8", str, None),  # GEMM inputs kept for the backward in FP8 (one byte)
    "--dualpipe-shared-shard-group": ("shared_shard", None, False),
    "--dualpipe-dp-first": ("dp_first", None, False),
    "--position-embedding-type": ("position_embedding", str, "learned_absolute"),
    "--fine-grained-activation-offloading": ("offload", None, False),  # megatron-core 0.19's
    "--offload-modules": ("offload_modules", list, ()),
}
#: ``--recompute-modules``' values at both supported tags (gdn_norm_out: 0.19's GatedDeltaNet, not GPT's).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
_NEEDED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")


class _Shape:
    """What the cost model needs of a run: the model's shape and its parallel sizes, one attribute per
    :data:`_FLAGS` entry (``gqa`` and ``moe_layer_freq`` become ``query_groups`` and ``moe_pattern``)."""

    def flag_set(self, flag: str) -> bool:
        """Whether Megatron-LM's switch ``flag`` (one this module reads) is on."""
        return bool(getattr(self, _FLAGS[flag][0]))

    @property
    def padded_vocab(self) -> int:
        """The vocabulary padded as Megatron pads it: to a multiple of the divisor times TP."""
        unit = self.vocab_divisible_by * self.tp
        return -(-self.vocab_size // unit) * unit

    @property
    def model_size(self) -> int:
        """GPUs one model replica spans for dense layers (TP x PP x CP)."""
        return self.tp * self.pp * self.cp


#: :class:`_Shape` as the frozen dataclass :func:`parse` fills: the flags' attributes are its fields.
ModelArgs = make_dataclass("ModelArgs", [n for n, _, _ in _FLAGS.values() if n not in ("gqa", "moe_layer_freq")]
                           + ["moe_pattern"], bases=(_Shape,), frozen=True,
                           namespace={"__module__": __name__, "__doc__": _Shape.__doc__})


def moe_pattern(freq: str, num_layers: int) -> Tuple[int, ...]:
    """Megatron's ``--moe-layer-freq``: N (every N-th layer, from the first) or a pattern such as
    ``([0]*3+[1]*58)`` (1: an MoE layer), which must have one entry per layer."""
    text = freq.replace(" ", "")
    if re.fullmatch(r"[0-9]+", text):
        n = int(text)
        if n < 1:
            raise ModelArgsError(f"--moe-layer-freq {freq}: must be >= 1")
        return tuple(1 if i % n == 0 else 0 for i in range(num_layers))
    pattern = _pattern(text)
    if pattern is None or len(pattern) != num_layers:
        got = "cannot be read" if pattern is None else f"has {len(pattern)} entries"
        raise ModelArgsError(f"--moe-layer-freq {freq} {got}: give N or a list expression like ([0]*3+[1]*{num_layers - 3})"
                             f" with one 0/1 per layer ({num_layers})")
    return tuple(pattern)


def _pattern(text: str) -> Optional[List[int]]:
    """``([1]*3+[0]*1)*3`` and ``[0,1,1]`` forms, read without ``eval``."""
    m = re.fullmatch(r"\((.*)\)\*([0-9]+)", text)
    if m:
        inner = _pattern(m.group(1))
        return None if inner is None else inner * int(m.group(2))
    if text.startswith("(") and text.endswith(")"):
        return _pattern(text[1:-1])
    out: List[int] = []
    for term in text.split("+"):
        t = re.fullmatch(r"\[([01](?:,[01])*)\](?:\*([0-9]+))?", term)
        if not t:
            return None
        out += [int(x) for x in t.group(1).split(",")] * int(t.group(2) or 1)
    return out


def _values(argv: Sequence[str]) -> Dict[str, object]:
    found: Dict[str, object] = {}
    args = list(argv)
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if flag not in _FLAGS:
            continue
        name, kind, _ = _FLAGS[flag]
        if kind is None:
            found[name] = True
            continue
        if kind is list:  # nargs='+': the words up to the next flag
            end = next((k for k in range(i + 1, len(args)) if args[k].startswith("--")), len(args))
            if end == i + 1:
                raise ModelArgsError(f"{flag} needs at least one value")
            found[name] = tuple(args[i + 1:end])
            continue
        raw = val if eq else (args[i + 1] if i + 1 < len(args) else None)
        if raw is None or (not eq and raw.startswith("--")):
            raise ModelArgsError(f"{flag} needs a value")
        if kind is int:
            if not re.fullmatch(r"[0-9]+", raw) or int(raw) < 1:
                raise ModelArgsError(f"{flag} {raw}: must be a positive integer")
            found[name] = int(raw)
        else:
            found[name] = raw
    return found


def parse(argv: Sequence[str]) -> ModelArgs:
    """The :class:`ModelArgs` of ``pretrain_gpt.py ARGV`` (Megatron-LM's defaults for the rest)."""
    missing = [f for f in _NEEDED if _FLAGS[f][0] not in _values(argv)]
    if missing:
        raise ModelArgsError(f"the model needs {', '.join(missing)}: give them (or a --config that has them)")
    v = {name: default for name, _, default in _FLAGS.values()}
    v.update(_values(argv))
    if v["vocab_size"] is None:
        raise ModelArgsError("the output layer's cost needs the vocabulary: give --vocab-size N (the tokenizer's, e.g. "
                             "128256 for Llama 3, 129280 for DeepSeek-V3)")
    h, heads = v["hidden"], v["heads"]
    if h % heads:
        raise ModelArgsError(f"--hidden-size {h} is not a multiple of --num-attention-heads {heads}: give --kv-channels")
    v["ffn_hidden"] = v["ffn_hidden"] or 4 * h
    v["kv_channels"] = v["kv_channels"] or h // heads
    v["query_groups"] = (v["query_groups"] if v.pop("gqa") else None) or heads
    v["moe_ffn_hidden"] = v["moe_ffn_hidden"] or v["ffn_hidden"]
    v["etp"] = v["etp"] or v["tp"]
    v["sequence_parallel"] = v["sequence_parallel"] and v["tp"] > 1  # Megatron turns it off without TP
    selective = v["recompute"] == "selective"
    v["recompute_modules"] = tuple(v["recompute_modules"] or ("core_attn",)) if selective else ()
    if v["offload"] and not v["offload_modules"]:
        raise ModelArgsError("--fine-grained-activation-offloading needs --offload-modules (e.g. core_attn expert_fc1)")
    unknown = sorted(set(v["recompute_modules"]) - set(RECOMPUTE_MODULES))
    if unknown:
        raise ModelArgsError(f"--recompute-modules {' '.join(unknown)}: not one of {', '.join(RECOMPUTE_MODULES)}")
    freq = v.pop("moe_layer_freq")
    v["moe_pattern"] = moe_pattern(str(freq), v["num_layers"]) if v["num_experts"] else (0,) * v["num_layers"]
    if v["layout"] is not None:
        if v["first_stage_layers"] is not None or v["last_stage_layers"] is not None:
            raise ModelArgsError("--pipeline-model-parallel-layout places every layer itself: drop "
                                 "--decoder-first/last-pipeline-num-layers (Megatron refuses both together)")
        try:  # pp stages (1F1B, DualPipe) or 2*pp V-stages (DualPipeV) holding every layer
            stages = parse_layout(v["layout"])
        except LayoutError as e:
            raise ModelArgsError(str(e)) from None
        if len(stages) not in (v["pp"], 2 * v["pp"]) or sum(decoder_counts(stages)) != v["num_layers"]:
            raise ModelArgsError(f"--pipeline-model-parallel-layout {v['layout']!r}: {len(stages)} stages of "
                                 f"{sum(decoder_counts(stages))} layers; give {v['pp']} (or DualPipeV's {2 * v['pp']}) "
                                 f"stages of --num-layers {v['num_layers']}")
    if v["num_experts"] and v["topk"] > v["num_experts"]:
        raise ModelArgsError(f"--moe-router-topk {v['topk']} is more than --num-experts {v['num_experts']}")
    return ModelArgs(**v)


"""A pipeline stage's costs and memory from the model's shape, for advice before any run: FLOPs as Megatron-LM's
``num_floating_point_operations`` counts them at ``mfu`` of the GPU's peak, MoE's all-to-all at link bandwidth (tensor
parallel's not modelled), memory as ``report_theoretical_memory`` accounts it. Standard library only, like
``schedule``."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from ..schedule import stage_layout
from .activation_memory import OUTPUT, stage_terms
from .model_args import ModelArgs

GB = 1e9
BF16, FP32 = 2, 4
#: Adam's state per parameter: fp32 master weights and two fp32 moments.
OPTIMIZER_BYTES = 12
#: Default share of the peak rate that training sustains (model FLOPs utilisation).
DEFAULT_MFU = 0.4


@dataclass(frozen=True)
class Gpu:
    """A GPU kind from its datasheet (SXM): dense bf16 tensor rate, HBM, NVLink bandwidth per
    direction, and the usual network bandwidth per GPU (one 400 Gb/s NIC; 200 Gb/s for A100)."""

    name: str
    peak_tflops: float
    hbm_gb: float
    nvlink_gbps: float
    network_gbps: float


GPUS = {g.name: g for g in (
    Gpu("A100", 312.0, 80.0, 300.0, 25.0),
    Gpu("H100", 989.0, 80.0, 450.0, 50.0),
    Gpu("H800", 989.0, 80.0, 200.0, 50.0),  # H100's compute, NVLink cut to 400 GB/s both ways
    Gpu("H200", 989.0, 141.0, 450.0, 50.0),
    Gpu("B200", 2250.0, 180.0, 900.0, 50.0),
)}


# FLOPs (forward, per token)

def attention_params(m: ModelArgs, norm: int) -> int:
    """One attention layer's projection weights (MLA: with its latents' norms, ``norm`` weights per element)."""
    h, n = m.hidden, m.heads
    if not m.mla:
        q, kv = m.kv_channels * n, m.kv_channels * m.query_groups
        return h * (q + 2 * kv) + q * h
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    q = h * n * qk if m.q_lora_rank is None else m.q_lora_rank * (h + n * qk + norm)
    return (q + m.kv_lora_rank * (h + n * (m.qk_head_dim + m.v_head_dim) + norm) + h * m.qk_pos_emb_head_dim
            + n * m.v_head_dim * h)


def mlp_width(m: ModelArgs, moe: bool) -> int:
    """The MLP hidden width a token goes through (MoE: its routed experts' plus the shared ones)."""
    return m.topk * m.moe_ffn_hidden + m.shared_expert if moe else m.ffn_hidden


def mlp_flops(m: ModelArgs, moe: bool) -> float:
    return 2.0 * m.hidden * mlp_width(m, moe) * (3 if m.swiglu else 2)


def layer_flops(m: ModelArgs, moe: bool) -> Tuple[float, float]:
    """(linear, core) forward FLOPs per token of one transformer layer (causal: half of ``QK^T``, ``softmax V``)."""
    n, s = m.heads, m.seq_length
    core = s * n * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) if m.mla else 2 * m.kv_channels * n * s
    return float(2 * attention_params(m, 1)) + mlp_flops(m, moe), float(core)


def output_flops(m: ModelArgs) -> float:
    """The logits of one token (the output layer), forward."""
    return 2.0 * m.hidden * m.padded_vocab


def mtp_flops(m: ModelArgs) -> Tuple[float, float]:
    """(linear, core) forward FLOPs per token of the MTP block: per depth a layer, a projection, logits."""
    if not m.mtp_layers:
        return 0.0, 0.0
    linear, core = layer_flops(m, bool(m.moe_pattern[-1]))
    extra = 2.0 * (3 * m.hidden + 2 * m.hidden * m.hidden) + output_flops(m)
    return m.mtp_layers * (linear + extra), m.mtp_layers * core


def iteration_flops(m: ModelArgs, global_batch: int) -> float:
    """The model FLOPs of one iteration (forward and backward, three GEMMs per weight)."""
    return 3.0 * global_batch * m.seq_length * sum(_token_flops(m, m.moe_pattern, True))


def _token_flops(m: ModelArgs, moe_flags: Sequence[int], last: bool) -> Tuple[float, float]:
    """(linear, core) forward FLOPs per token of layers with these MoE flags (``last``: + output, MTP)."""
    parts = [layer_flops(m, bool(moe)) for moe in moe_flags] + ([mtp_flops(m), (output_flops(m), 0.0)] if last else [])
    return sum(lin for lin, _ in parts), sum(core for _, core in parts)


# Stages

def stage_sizes(m: ModelArgs) -> Tuple[int, ...]:
    """Layers per pipeline stage as Megatron splits them (a DualPipeV layout's stage t: V-stages 2t, 2t+1)."""
    if m.layout is not None:
        counts = stage_layout.decoder_counts(stage_layout.parse(m.layout))
        return counts if len(counts) == m.pp else tuple(counts[i] + counts[i + 1] for i in range(0, 2 * m.pp, 2))
    ends = [n for n in (m.first_stage_layers, m.last_stage_layers) if n is not None]
    middle = m.pp - len(ends)
    per = (m.num_layers - sum(ends)) // middle if middle else 0
    sizes = [per] * m.pp
    if m.first_stage_layers is not None:
        sizes[0] = m.first_stage_layers
    if m.last_stage_layers is not None:
        sizes[-1] = m.last_stage_layers
    return tuple(sizes)


def v_stage_sizes(m: ModelArgs) -> Tuple[int, ...]:
    """Layers per DualPipeV V-stage: the layout's 2*pp, else each stage cut in two (``stage_layout.halved``)."""
    if m.layout is not None and len(stage_layout.parse(m.layout)) == 2 * m.pp:
        return stage_layout.decoder_counts(stage_layout.parse(m.layout))
    return tuple(n for size in stage_sizes(m) for n in (size // 2, size - size // 2))


def partition_f(m: ModelArgs, gpu: Gpu, mfu: float, gpus_per_node: int, sizes: Sequence[int],
                a2a_bandwidth: Optional[float] = None) -> Tuple[float, ...]:
    """Forward ms per micro-batch of consecutive stages of ``sizes`` layers, priced as :func:`stage_costs`."""
    rate, a2a = gpu.peak_tflops * 1e12 * mfu / 1e3, all_to_all_ms(m, gpu, gpus_per_node, a2a_bandwidth)
    out, start = [], 0
    for i, n in enumerate(sizes):
        flags = m.moe_pattern[start:start + n]
        linear, core = _span_flops(m, flags, i == len(sizes) - 1)
        last = m.mtp_layers * m.moe_pattern[-1] if i == len(sizes) - 1 else 0
        out.append((linear + core) / rate + (sum(flags) + last) * a2a)
        start += n
    return tuple(out)


def stage_layers(m: ModelArgs, stage: int) -> Tuple[int, ...]:
    """The MoE flags (1: MoE) of the layers of pipeline stage ``stage``."""
    sizes = stage_sizes(m)
    start = sum(sizes[:stage])
    return m.moe_pattern[start:start + sizes[stage]]


def stage_flops(m: ModelArgs, stage: int) -> Tuple[float, float]:
    """(weight GEMMs, core attention) forward FLOPs of one micro-batch on one rank of ``stage``."""
    return _span_flops(m, stage_layers(m, stage), stage == m.pp - 1)


def _span_flops(m: ModelArgs, moe_flags: Sequence[int], last: bool) -> Tuple[float, float]:
    """(weight GEMMs, core attention) forward FLOPs on one rank of these layers (``last``: + output, MTP)."""
    linear, core = _token_flops(m, moe_flags, last)
    tokens = m.micro_batch * m.seq_length
    return tokens * linear / (m.tp * m.cp), tokens * core / (m.tp * m.cp)


def all_to_all_ms(m: ModelArgs, gpu: Gpu, gpus_per_node: int, bandwidth: Optional[float] = None) -> float:
    """One MoE layer's dispatch and combine on a rank, one direction (ms)."""
    if m.ep == 1 or not m.num_experts:
        return 0.0
    tokens = m.micro_batch * m.seq_length / m.cp / (m.tp if m.sequence_parallel else 1)
    volume = 2 * tokens * m.topk * m.hidden * BF16 * (m.ep - 1) / m.ep
    inside = m.etp * m.ep <= gpus_per_node
    bw = bandwidth or (gpu.nvlink_gbps if inside else gpu.network_gbps)
    return volume / (bw * GB) * 1e3


@dataclass(frozen=True)
class StageCosts:
    """One stage's times per micro-batch (ms) as 1F1B runs it (``fb`` None: f + b)."""

    stage: int
    f: float
    b: float
    w: float
    fb: Optional[float]
    all_to_all: float


def recompute_flops(m: ModelArgs, moe: bool) -> float:
    """Forward FLOPs per token that one layer's recomputation runs again in its backward."""
    linear, core = layer_flops(m, moe)
    if m.recompute == "full":
        return linear + core
    mods, gate = set(m.recompute_modules), 3 if m.swiglu else 2
    out = core if "core_attn" in mods else 0.0
    if m.mla and "mla_up_proj" in mods:
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        out += 2.0 * m.heads * ((m.q_lora_rank or 0) * qk + m.kv_lora_rank * (m.qk_head_dim + m.v_head_dim))
    if not moe and "mlp" in mods:
        out += mlp_flops(m, False)
    if moe and "moe" in mods:
        out += mlp_flops(m, True)
    elif moe and "shared_experts" in mods:
        out += 2.0 * m.hidden * m.shared_expert * gate
    return out


def stage_costs(m: ModelArgs, gpu: Gpu, mfu: float, gpus_per_node: int, stage: int,
                a2a_bandwidth: Optional[float] = None) -> StageCosts:
    rate = gpu.peak_tflops * 1e12 * mfu / 1e3  # FLOPs per ms
    linear, core = stage_flops(m, stage)
    fc, wc = (linear + core) / rate, linear / rate
    flags, mtp = stage_layers(m, stage), m.mtp_layers * m.moe_pattern[-1] if stage == m.pp - 1 else 0
    a2a = (sum(flags) + mtp) * all_to_all_ms(m, gpu, gpus_per_node, a2a_bandwidth)  # the MTP block's MoE layers too
    tokens = m.micro_batch * m.seq_length / (m.tp * m.cp)
    again = tokens * sum(recompute_flops(m, bool(x)) for x in flags) / rate
    again_a2a = a2a if m.recompute == "full" or "moe" in m.recompute_modules else 0.0
    f, b, w = fc + a2a, 2 * fc + a2a + again + again_a2a, wc
    fb = max(fc + 2 * fc + again, 2 * a2a + again_a2a, f, b - w) if a2a else None
    return StageCosts(stage, f, b, w, fb, a2a)


def heaviest_stage(m: ModelArgs, gpu: Gpu, mfu: float, gpus_per_node: int,
                   a2a_bandwidth: Optional[float] = None) -> StageCosts:
    """The slowest stage (it paces the pipeline; the simulator takes one cost for every stage)."""
    return max((stage_costs(m, gpu, mfu, gpus_per_node, s, a2a_bandwidth) for s in range(m.pp)),
               key=lambda c: c.f + c.b)


# Memory

@dataclass(frozen=True)
class Params:
    """Parameters by how ranks hold them: split by TP, replicated, split by EP x ETP."""

    tp: float = 0.0
    replicated: float = 0.0
    expert: float = 0.0

    def __add__(self, o: "Params") -> "Params":
        return Params(self.tp + o.tp, self.replicated + o.replicated, self.expert + o.expert)

    def scaled(self, k: float) -> "Params":
        return Params(self.tp * k, self.replicated * k, self.expert * k)


def layer_params(m: ModelArgs, moe: bool) -> Params:
    h, gl = m.hidden, 1.5 if m.swiglu else 1.0
    norm = 1 if m.normalization == "RMSNorm" else 2
    attn = attention_params(m, norm)
    if not moe:
        return Params(attn + 2 * h * m.ffn_hidden * gl, 2 * h * norm)
    router = h * m.num_experts
    return Params(attn + 2 * h * m.shared_expert * gl, 2 * h * norm + router,
                  2 * h * m.moe_ffn_hidden * m.num_experts * gl)


def stage_params(m: ModelArgs, stage: int) -> Tuple[Params, Params, Params]:
    """(layers, embedding or output layer, MTP block) of ``stage``, whole (before TP/EP splits)."""
    layers = sum((layer_params(m, bool(moe)) for moe in stage_layers(m, stage)), Params())
    vocab = Params(m.hidden * m.padded_vocab)
    norm = 1 if m.normalization == "RMSNorm" else 2
    ends, mtp = vocab if stage == 0 else Params(), Params()
    if stage == m.pp - 1:
        ends = ends + Params(replicated=norm * m.hidden) + (vocab if m.pp > 1 or m.untie else Params())
        mtp = layer_params(m, bool(m.moe_pattern[-1])).scaled(m.mtp_layers)
    return layers, ends, mtp


@dataclass(frozen=True)
class Memory:
    """One rank's memory in bytes: parameters, gradients, optimizer state, one micro-batch's activations."""

    stage: int
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    #: the output layer's logits, kept once per rank whatever the schedule (freed by the loss's backward)
    activations_once: float = 0.0

    @property
    def states(self) -> float:
        """What ``advise`` calls the parameter memory: parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer


def rank_bytes(m: ModelArgs, p: Params, world: int) -> Tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes on one rank for the whole-stage parameters ``p``."""
    dense = p.tp / m.tp + p.replicated
    expert = p.expert / (m.ep * m.etp)
    dp = world // m.model_size
    edp = world // (m.etp * m.ep * m.pp)
    opt = (dense * OPTIMIZER_BYTES / (dp if m.distributed_optimizer else 1)
           + expert * OPTIMIZER_BYTES / (edp if m.distributed_optimizer else 1))
    return (dense + expert) * BF16, (dense + expert) * FP32, opt


def activation_bytes(m: ModelArgs) -> float:
    """Megatron-LM's own figure for one micro-batch's activations on the first stage, for comparison."""
    s, b, h = m.seq_length / m.cp, m.micro_batch, m.hidden
    layers = stage_layers(m, 0)
    embedding = 8 * s * b + s * b * h
    output = 0.0
    if m.recompute == "full":
        per = sum(2 * s * b * h for _ in layers) / (m.tp if m.sequence_parallel else 1)
        return per + embedding
    if m.sequence_parallel and m.recompute == "selective":
        per = sum(s * b * h * (18 + 4 * mlp_width(m, bool(moe)) / h) for moe in layers)
        if m.pp == 1:
            output = s * b * h * 4 * (1 + m.padded_vocab / h)
        return (per + embedding + output) / m.tp
    per = len(layers) * s * b * h * (10 + 24 / m.tp)
    if m.pp == 1:
        output = (s * b * m.padded_vocab / m.tp + s * b * h) * 2
    return (per + embedding + output) * 1.05


def stage_activations(m: ModelArgs, stage: int) -> Tuple[float, float]:
    """(per micro-batch in flight, once) activations on one rank of ``stage`` (``activation_memory``)."""
    terms = stage_terms(m, stage_layers(m, stage), stage == 0, stage == m.pp - 1)
    once = terms.pop(OUTPUT, 0.0)
    return sum(terms.values()), once


def heaviest_memory(m: ModelArgs, world: int) -> Memory:
    """The stage with the most parameter memory, with the largest activations of any stage."""
    stages = [Memory(s, *rank_bytes(m, sum(stage_params(m, s), Params()), world), *stage_activations(m, s))
              for s in range(m.pp)]
    return replace(max(stages, key=lambda x: x.states), activations=max(x.activations for x in stages),
                   activations_once=max(x.activations_once for x in stages))


def stages_problem(m: ModelArgs) -> Optional[str]:
    if m.layout is not None:  # model_args checked it
        return None
    ends = [n for n in (m.first_stage_layers, m.last_stage_layers) if n is not None]
    middle = m.pp - len(ends)
    uneven_flags = ("--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers, or "
                    "--pipeline-model-parallel-layout")
    if not ends and m.num_layers % m.pp:
        return (f"--num-layers {m.num_layers} is not a multiple of --pipeline-model-parallel-size {m.pp}: "
                f"change one, or split unevenly ({uneven_flags})")
    if ends and (middle < 0 or (middle and (m.num_layers - sum(ends)) % middle)
                 or (not middle and sum(ends) != m.num_layers)):
        return (f"--num-layers {m.num_layers} less {uneven_flags} ({', '.join(map(str, ends))}) does not split "
                f"evenly over the other {middle} of --pipeline-model-parallel-size {m.pp}: change one")
    return None


def describe(m: ModelArgs) -> List[str]:
    """The model in a few words: layers by kind, attention, MoE, MTP."""
    moe = sum(m.moe_pattern)
    kinds = f"{m.num_layers - moe} dense + {moe} MoE layers" if moe else f"{m.num_layers} dense layers"
    attn = "MLA" if m.mla else ("GQA" if m.query_groups != m.heads else "MHA")
    parts = [kinds, f"hidden {m.hidden}", f"{attn} {m.heads} heads", f"seq {m.seq_length}",
             f"vocab {m.padded_vocab}"]
    if moe:
        parts.append(f"{m.num_experts} experts, top-{m.topk}"
                     + (f" + shared {m.shared_expert}" if m.shared_expert else ""))
    if m.mtp_layers:
        parts.append(f"MTP {m.mtp_layers}")
    return parts

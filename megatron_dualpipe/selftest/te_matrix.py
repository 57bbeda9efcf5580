"""With ``--te``, the equality stage also runs the TE matrix's combinations (proven on the CPU through
the stand-ins) on its tiny model, so that a GPU user proves them with the real Transformer Engine,
grouped GEMM and DeepEP: one line each against Megatron's 1F1B, or SKIP with what it needs.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import List, Optional, Tuple

from ..proof import models
from .against_1f1b import vs_1f1b
from ..schedule.registry import DUALPIPE, DUALPIPEV

NEEDS_EP = "needs expert parallelism: run with --ep 2"
MTP = (("mtp_num_layers", 1),)
ROPE = (("position_embedding_type", "rope"),)
#: Why the fused units with MTP run in fp32 on a GPU too.
FP32_MTP = "fp32: in half precision the plugin refuses MTP in the fused units"


def combinations(cfg) -> List[Tuple[str, Optional[models.ModelSpec], Optional[str]]]:
    """(name, spec, None) of every combination this run can prove, (name, None, why) of the others."""
    # no linear biases (as in the matrix): TE's deferral loses a bias gradient under B, B, W, W (refused);
    # RoPE: a learned position embedding would stay fp32 (Megatron-LM's Float16Module casts it), and so
    # would every activation after it; DeepEP combines bf16 only
    gpt = dataclasses.replace(cfg.spec(), fp8=False, te_deferral=True, config=(("add_bias_linear", False),), model=ROPE)
    moe = dataclasses.replace(cfg.spec(moe=True), fp8=False, te_deferral=True, model=ROPE)
    ep = None if cfg.ep > 1 else NEEDS_EP
    recompute = (("recompute_granularity", "selective"),)
    grouped = dataclasses.replace(moe, combined_step=False, config=moe.config + recompute + (
        ("moe_grouped_gemm", True), ("moe_shared_expert_intermediate_size", moe.hidden),
        ("moe_shared_expert_overlap", True), ("moe_layer_freq", [1, 0] * (moe.layers // 2)),
        ("recompute_modules", ["core_attn", "mlp", "layernorm", "moe_act", "moe"])))
    mla = models.multi_latent(moe)
    fused_mtp = dataclasses.replace(mla, dtype="fp32", config=mla.config + MTP + recompute + (
        ("moe_shared_expert_intermediate_size", moe.hidden), ("recompute_modules", ["shared_experts", "mla_up_proj"])))
    fp8 = dataclasses.replace(gpt, fp8=True, config=gpt.config + (
        ("first_last_layers_bf16", True), ("num_layers_at_start_in_bf16", 1), ("num_layers_at_end_in_bf16", 1)))
    flex = dataclasses.replace(moe, dtype="bf16", config=moe.config + (
        ("moe_token_dispatcher_type", "flex"), ("moe_flex_dispatcher_backend", "deepep"), ("moe_grouped_gemm", True)))
    rows = [
        ("MTP, zero bubble through TE's delayed wgrad",
         dataclasses.replace(gpt, config=gpt.config + MTP), None),
        ("MoE, grouped GEMM, overlapped shared experts, selective recomputation (core_attn, mlp, layernorm, "
         "moe_act, moe), zero bubble through TE", grouped, ep),
        ("MoE, shared experts, MLA, fused F&B units, MTP, selective recomputation (shared_experts, mla_up_proj)",
         fused_mtp, ep),
        ("FP8 tensorwise, first and last layers in bf16, zero bubble through TE", fp8, _fp8_problem(cfg)),
        ("MoE, flex dispatcher (DeepEP), grouped GEMM, fused F&B units", flex, ep or _deepep_problem()),
    ]
    return [(name, None if why else spec, why) for name, spec, why in rows]


def _fp8_problem(cfg) -> Optional[str]:
    """Why the FP8 combination cannot run here (None: it can)."""
    if not cfg.fp8:
        return "run with --fp8 (FP8 GEMMs: a GPU of compute capability 8.9 or newer)"
    if not cfg.gpu:
        return None  # the stand-in enters the recipe as a no-op for the numbers
    try:
        from transformer_engine.pytorch import fp8

        ok, why = fp8.check_fp8_support()
    except (ImportError, AttributeError):
        import torch

        cc = torch.cuda.get_device_capability()
        ok, why = cc >= (8, 9), f"compute capability {cc[0]}.{cc[1]} < 8.9"
    return None if ok else f"this GPU cannot run FP8: {why}"


def _deepep_problem() -> Optional[str]:  # on the CPU the stand-in answers
    missing = importlib.util.find_spec("deep_ep") is None
    return "DeepEP is not installed here (the deep_ep package, built for this GPU's CUDA)" if missing else None


def run(ctx) -> dict:
    """Every runnable combination under each schedule: this rank's losses and gradients."""
    out = {"skipped": {}, "results": {}}
    for name, spec, why in combinations(ctx.cfg):
        if spec is None:
            out["skipped"][name] = why
            continue
        full = models.full_state_dict(spec)
        losses, grads = {}, {}
        for schedule in models.SCHEDULES:
            chunks = models.build(spec, schedule, full)
            losses[schedule] = models.run_iteration(spec, schedule, chunks, models.batches(spec, 2 * ctx.cfg.pp),
                                                    p2p_timeout=ctx.cfg.deadline_s)
            grads[schedule] = models.grads_by_full_name(chunks, full)
        out["results"][name] = {"losses": losses, "grads": grads}
    return out


def _described(spec: models.ModelSpec) -> str:
    return (f"{spec.layers} layers, hidden {spec.hidden}, {spec.dtype}{' fp8' if spec.fp8 else ''}, "
            f"{'fused F&B units' if spec.combined_step else 'no fused units'}")


def judge(ctx, payloads: List[dict], details: List[str], failures: List[str]) -> Tuple[List[str], dict]:
    """(result lines, numbers) of the combinations, compared as equality's models, details and failures added."""
    matrix = payloads[0]["te_matrix"]
    lines, numbers = [], {}
    for name, spec, why in combinations(ctx.cfg):
        if name in matrix["skipped"]:
            lines.append(f"[SKIP] {name}: {matrix['skipped'][name]}")
            numbers[name] = {"skipped": matrix["skipped"][name]}
            continue
        tol = ctx.cfg.tolerance_of(spec)
        by_coord = {tuple(p["coord"]): p["te_matrix"]["results"][name] for p in payloads}
        mine = []
        details.append(f"{name}: {_described(spec)}; tolerance {tol:g}")
        numbers[name] = {s: vs_1f1b(ctx, name, by_coord, s, tol, mine, details) for s in (DUALPIPE, DUALPIPEV)}
        gaps = ", ".join(f"{s} loss {numbers[name][s]['max_rel_loss_diff']:.1e} grad "
                         f"{numbers[name][s]['max_rel_grad_diff']:.1e}" for s in (DUALPIPE, DUALPIPEV))
        note = f"; {FP32_MTP}" if spec.combined_step and spec.dtype == "fp32" and ctx.cfg.gpu else ""
        lines.append(f"[{'FAIL' if mine else 'PASS'}] {name}: largest relative difference against Megatron 1F1B "
                     f"(tolerance {tol:g}): {gaps}{note}")
        failures += mine
    return lines, numbers

"""Stage ``deepseek-v3``: the tiny DeepSeek-V3-shaped model from the same weights under Megatron's
1F1B, DualPipe and DualPipeV (fused F&B units and interleaved 1F1B with all-to-all overlap with
``--ep``): losses and gradients held to 1F1B's, then a few timed iterations each, reported and never
judged (the CPU ranks share cores, a tiny model measures latency).
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import against_1f1b, faults
from ..proof import data, models
from .result import FAIL, PASS, StageResult
from ..schedule.registry import DUALPIPE, DUALPIPEV, INTERLEAVED_1F1B, ONE_F_ONE_B

NAME = "deepseek-v3"
INTERLEAVED_NEEDS = ("interleaved 1F1B with its all-to-all overlap (--overlap-moe-expert-parallel-comm) needs expert "
                     "parallelism: run with --ep 2")


def schedules(cfg) -> Tuple[str, ...]:
    """1F1B first (the reference), then the schedules held to it."""
    return (ONE_F_ONE_B, DUALPIPE, DUALPIPEV) + ((INTERLEAVED_1F1B,) if cfg.ep > 1 else ())


def _label(schedule: str, spec) -> str:
    if schedule == INTERLEAVED_1F1B:
        return "interleaved 1F1B + A2A overlap" if spec.combined_step else "interleaved 1F1B"
    return f"{schedule} (fused F&B units)" if spec.combined_step and schedule != ONE_F_ONE_B else schedule


def _timed(ctx, spec, schedule: str, chunks) -> dict:
    """Seconds of each timed iteration on this rank (started together) and the peak GPU memory meanwhile."""
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for step in range(1, 3 if ctx.cfg.quick else 11):
        models.zero_grads(chunks)
        micro = models.batches(spec, 2 * ctx.cfg.pp, step)
        dist.barrier()
        start = time.perf_counter()
        models.run_iteration(spec, schedule, chunks, micro, p2p_timeout=ctx.cfg.deadline_s)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def _counting_plans(counts: dict):
    """``forward_step`` that counts the calls asking for a schedule plan: the combined step's."""
    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        counts["plans"] = counts.get("plans", 0) + bool(return_schedule_plan)
        return data.forward_step(data_iterator, model, return_schedule_plan)
    return forward_step


def run(ctx) -> dict:
    spec = ctx.cfg.spec_v3()
    full = models.full_state_dict(spec)
    out = {"coord": ctx.coord, "losses": {}, "grads": {}, "timing": {}, "plans": {}}
    for schedule in schedules(ctx.cfg):
        chunks = models.build(spec, schedule, full)
        counts = {}
        out["losses"][schedule] = models.run_iteration(spec, schedule, chunks, models.batches(spec, 2 * ctx.cfg.pp),
                                                       p2p_timeout=ctx.cfg.deadline_s,
                                                       forward_step_func=_counting_plans(counts))
        out["plans"][schedule] = counts.get("plans", 0)
        faults.wrong_gradient(schedule, chunks)
        out["grads"][schedule] = models.grads_by_full_name(chunks, full)
        out["timing"][schedule] = _timed(ctx, spec, schedule, chunks)
        del chunks
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _speed(ctx, spec, payloads: List[dict], schedule: str) -> dict:
    """Tokens per second of the slowest rank (median over the timed iterations) and the largest peak."""
    per_iteration = [max(ranks) for ranks in zip(*(p["timing"][schedule]["seconds"] for p in payloads))]
    tokens = 2 * ctx.cfg.pp * spec.mbs * spec.seq * (ctx.cfg.world // (ctx.cfg.tp * ctx.cfg.pp))  # all dp replicas
    peaks = [p["timing"][schedule]["peak_bytes"] for p in payloads]
    peak: Optional[int] = None if None in peaks else max(peaks)
    median = statistics.median(per_iteration)
    return {"tokens_per_s": tokens / median, "iteration_ms": 1e3 * median, "iterations": len(per_iteration),
            "tokens_per_iteration": tokens, "peak_bytes": peak,
            "peak_rank": None if peak is None else peaks.index(peak)}


def _speed_line(label: str, s: dict) -> str:
    memory = ("not measured (CPU)" if s["peak_bytes"] is None
              else f"{s['peak_bytes'] / 2 ** 20:.1f} MiB (rank {s['peak_rank']})")
    return (f"{label}: {s['tokens_per_s']:.0f} tokens/s ({s['tokens_per_iteration']} tokens in "
            f"{s['iteration_ms']:.1f} ms, median of {s['iterations']} iterations after a warm-up, slowest rank); "
            f"peak memory {memory}")


def judge(ctx, payloads: List[dict]) -> StageResult:
    cfg, tol = ctx.cfg, ctx.cfg.tolerance
    spec = cfg.spec_v3()
    by_coord = {tuple(p["coord"]): p for p in payloads}
    details = [f"V3: {spec.label()}", f"tolerance ({cfg.dtype_key}): {tol:g} relative to the largest |value| of each "
                                      f"loss/tensor; same full weights, same micro-batches, one iteration"]
    failures, numbers = [], {}
    for schedule in schedules(cfg)[1:]:
        numbers[schedule] = against_1f1b.vs_1f1b(ctx, "V3", by_coord, schedule, tol, failures, details,
                                                 _label(schedule, spec))
    numbers["combined_step_forwards"] = {}
    for schedule in schedules(cfg)[1:]:
        plans = numbers["combined_step_forwards"][schedule] = sum(p["plans"][schedule] for p in payloads)
        if spec.combined_step and not plans:
            failures.append(f"V3 {schedule}: no forward went through megatron-core's combined step (the fused units "
                            f"or the all-to-all overlap did not run)")
        elif spec.combined_step:
            details.append(f"{_label(schedule, spec)}: {plans} forward steps (all ranks) through megatron-core's "
                           f"combined step")
    if cfg.ep == 1:
        details.append(f"not run: {INTERLEAVED_NEEDS}")
    numbers["speed"] = speed = {schedule: _speed(ctx, spec, payloads, schedule) for schedule in schedules(cfg)}
    details += [_speed_line(_label(s, spec), v) for s, v in speed.items()]
    details.append("speed not judged: " + ("the ranks share this machine's CPU cores" if not cfg.gpu else
                                           "the tiny model measures latency, not the all-to-all overlap"))
    if failures:
        return StageResult(NAME, FAIL, failures[0] + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""),
                           failures + details, numbers)
    gaps = ", ".join(f"{_label(s, spec)} loss {numbers[s]['max_rel_loss_diff']:.1e} grad "
                     f"{numbers[s]['max_rel_grad_diff']:.1e}" for s in schedules(cfg)[1:])
    rates = ", ".join(f"{s} {v['tokens_per_s']:.0f}" for s, v in speed.items())
    tail = "" if cfg.ep > 1 else f"; {INTERLEAVED_NEEDS}"
    return StageResult(NAME, PASS, f"vs Megatron 1F1B (tolerance {tol:g}): {gaps}; tokens/s {rates} "
                                   f"(not judged){tail}", details, numbers)

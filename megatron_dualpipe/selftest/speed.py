"""Stage ``speed``: ``megatron-dualpipe bench`` over all ranks, every schedule the executor runs
against the simulated makespan of the same costs, bd gradient sums in. On a GPU the stages multiply
matrices sized to the user's model (``--model-*``) and a schedule slower than :data:`SLOWER` times
its simulation FAILs softly; on the CPU they sleep their costs, not judged (the ranks share cores).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
from typing import List

import torch
import torch.distributed as dist

from ..bench import report
from ..bench.measure import BenchConfig, worker
from ..bench.synthetic import Spender, StageCosts
from ..pictures import timeline
from .result import FAIL, PASS, StageResult
from ..schedule import registry
from ..schedule.registry import DUALPIPE, EXECUTOR_1F1B

NAME = "speed"
#: Measured over simulated (with the measured P2P latency) above which the stage FAILs.
SLOWER = 1.5
MAX_GRAD_MB = 4096.0


def layer_flops(hidden: int, seq: int, mbs: int = 1) -> float:
    """Forward FLOPs of one GPT layer (attention and a 4h MLP): 24 b s h^2 + 4 b s^2 h."""
    return 24.0 * mbs * seq * hidden * hidden + 4.0 * mbs * seq * seq * hidden


def stage_costs(cfg, device):
    """(compute mode, f, b, w in ms, matmul side, grad MiB)."""
    if not cfg.gpu:
        scale = 0.25 if cfg.quick else 1.0  # sleeps: the quick run's wall time, not its CPU
        return "sleep", 20 * scale, 40 * scale, 20 * scale, 1024, 4.0
    n = cfg.model_hidden
    rate = torch.tensor([Spender("matmul", device, n).per_ms * 2.0 * n ** 3], dtype=torch.float64, device=device)
    dist.broadcast(rate, src=0)  # one rate for all ranks: rank 0's
    f = cfg.model_layers_per_stage * layer_flops(n, cfg.model_seq) / float(rate)
    grad_mb = min(MAX_GRAD_MB, 12.0 * n * n * cfg.model_layers_per_stage * 4 / (1 << 20))
    return "matmul", f, 2 * f, f, n, grad_mb


def bench_config(ctx):
    mode, f, b, w, size, grad_mb = stage_costs(ctx.cfg, ctx.device)
    return BenchConfig(schedules=registry.names(runs_on=registry.EXECUTOR), microbatches={ctx.world: (2 * ctx.world,)},
                       costs=StageCosts(f, b, w), mode=mode, matmul_size=size, shape=(8, 1024),
                       iters=2 if ctx.cfg.quick else 5, warmup=1 if ctx.cfg.quick else 2,
                       timeout_s=ctx.cfg.deadline_s, trace_dir=os.path.abspath(ctx.path("traces")), grad_mb=grad_mb)


def run(ctx) -> dict:
    cfg = bench_config(ctx)
    return {"config": cfg, "result": worker(ctx.rank, ctx.world, ctx.device, cfg)}


def timelines(ctx, trace_root: str, names) -> List[str]:
    """PNG and Perfetto JSON of each schedule's recorded iteration; the lines ``trace`` printed."""
    lines = []
    for name in sorted(names):
        directory = os.path.join(trace_root, name)
        png, js = f"timeline_{name}.png", f"timeline_{name}.json"
        args = argparse.Namespace(directory=directory, png=ctx.path(png), json=ctx.path(js), iteration=None,
                                  global_rank=None)
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                timeline.run(args)
        except (timeline.TraceError, OSError) as e:  # e.g. another node's ranks wrote their files there
            lines.append(f"{name}: no timeline ({e})")
            continue
        ctx.files += [png, js]
        lines += buf.getvalue().splitlines()[:1]
    return lines


def judge(ctx, payloads: List[dict]) -> StageResult:
    cfg = payloads[0]["config"]
    ranks = [p["result"] for p in payloads]
    latency, rows = report.rows(cfg, ctx.world, ranks)
    env = {"backend": ranks[0]["backend"], "device": ranks[0]["device"], "cores": os.cpu_count(),
           "matmuls_per_ms": ranks[0]["matmuls_per_ms"] or None}
    details = [f"pipeline: all {ctx.world} ranks (pp={ctx.world}), M={2 * ctx.world}",
               *report.table(cfg, {ctx.world: latency}, rows, env).splitlines()]
    names = [f"{r.schedule}_pp{r.pp}_m{r.microbatches}" for r in rows]
    details += ["", "timelines (measured above simulated):", *timelines(ctx, cfg.trace_dir, names)]
    by = {r.schedule: r for r in rows}
    parts = [f"{s} {r.median_ms:.0f} ms ({r.ratio_latency:.2f}x sim)" for s, r in by.items()]
    slow = [f"{s} {r.ratio_latency:.2f}x" for s, r in by.items() if r.ratio_latency and r.ratio_latency > SLOWER]
    if DUALPIPE in by and EXECUTOR_1F1B in by:
        sim = by[DUALPIPE].sim_latency_ms / by[EXECUTOR_1F1B].sim_latency_ms
        parts.append(f"dualpipe/1f1b {by[DUALPIPE].median_ms / by[EXECUTOR_1F1B].median_ms:.2f} (sim {sim:.2f})")
    summary = f"{cfg.mode} stages f={cfg.costs.f:.1f} b={cfg.costs.b:.1f} w={cfg.costs.w:.1f} ms: " + ", ".join(parts)
    numbers = report.to_json(cfg, {ctx.world: latency}, rows, env)
    if not ctx.cfg.gpu:  # the ranks share this machine's cores with each other and whatever else runs
        return StageResult(NAME, PASS, f"measured, not judged on the CPU ({ctx.world} processes on {os.cpu_count()} "
                                       f"cores): " + summary, details, numbers)
    if slow:
        return StageResult(NAME, FAIL, f"slower than {SLOWER}x the simulation: {', '.join(slow)}; " + summary,
                           details, numbers, hard=False)
    return StageResult(NAME, PASS, summary, details, numbers)

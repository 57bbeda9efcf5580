"""``megatron-dualpipe selftest``: on the user's own machines, in a few minutes, does DualPipe give
Megatron's 1F1B numbers, does it hang, is it faster, how much memory does it take (docs/selftest.md).
One process per rank, started here (``--nproc``) or by torchrun. This module only parses arguments
(no torch import until it runs).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

HELP = "prove on this machine or cluster that DualPipe equals Megatron's 1F1B, does not hang, and how fast it is"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (ranks) to start here (default: the GPUs here, or 4 without; under torchrun: "
                        "its world size)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size; > 1 adds a tiny MoE to the equality stage and the overlap stage, "
                        "and fused units and interleaved 1F1B with all-to-all overlap to the deepseek-v3 stage")
    p.add_argument("--te", action="store_true", help="build the layers with Transformer Engine, in bf16 on GPUs "
                   "(without a GPU: the CPU mode's stand-in for it, fp32)")
    p.add_argument("--fp8", action="store_true", help="with --te: FP8 (per-tensor current scaling, the tensorwise recipe)")
    p.add_argument("--out", default="selftest-out", metavar="DIR", help="where the report goes (default selftest-out)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (what CI runs)")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="seconds any point-to-point wait may take (default 60; 20 with --quick); any phase of a "
                        "stage may take 30 times that")
    g = p.add_argument_group("your model, for the speed stage's matrix-multiply stages (GPU)")
    g.add_argument("--model-hidden", type=int, default=4096, help="hidden size (default 4096)")
    g.add_argument("--model-seq", type=int, default=2048, help="tokens per micro-batch (default 2048)")
    g.add_argument("--model-layers-per-stage", type=int, default=2, help="transformer layers per stage (default 2)")


def _config(args):
    from ..bench.launch import under_torchrun
    from .options import SelftestConfig, check, default_world

    import torch

    gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if gpu else 0
    torchrun = under_torchrun()
    world = default_world(gpu, gpus) if args.nproc is None else args.nproc
    if torchrun and world != int(os.environ["WORLD_SIZE"]):
        raise ValueError(f"under torchrun the selftest runs on its {os.environ['WORLD_SIZE']} ranks: leave out --nproc")
    problem = check(world, args.tp, args.ep, args.te, args.fp8, gpu, gpus, torchrun)
    if problem:
        raise ValueError(problem)
    for name in ("model_hidden", "model_seq", "model_layers_per_stage"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    deadline = args.deadline if args.deadline is not None else (20.0 if args.quick else 60.0)
    if not deadline > 0:
        raise ValueError(f"--deadline must be > 0 seconds, got {deadline:g}")
    os.makedirs(args.out, exist_ok=True)
    flags = [f"--nproc {world}"] + [f"--{k} {getattr(args, k)}" for k in ("tp", "ep") if getattr(args, k) != 1]
    flags += [f"--{k}" for k in ("te", "fp8", "quick") if getattr(args, k)]
    flags += [] if args.deadline is None else [f"--deadline {args.deadline:g}"]
    command = " ".join(["megatron-dualpipe selftest", *flags, "--out", shlex.quote(args.out)])
    return SelftestConfig(world=world, tp=args.tp, ep=args.ep, te=args.te, fp8=args.fp8,
                          out=os.path.abspath(args.out), quick=args.quick, deadline_s=deadline, gpu=gpu,
                          command=command, model_hidden=args.model_hidden, model_seq=args.model_seq,
                          model_layers_per_stage=args.model_layers_per_stage), torchrun


def run(args) -> int:
    from ..bench import launch
    from .worker import preload, worker

    cfg, torchrun = _config(args)
    started = time.perf_counter()
    if not torchrun or os.environ.get("RANK") == "0":
        print(f"megatron-dualpipe selftest: {cfg.world} ranks (tp={cfg.tp} pp={cfg.pp} ep={cfg.ep}), "
              f"{'NCCL on GPUs' if cfg.gpu else 'gloo on the CPU (CPU mode)'}, report in {cfg.out}", flush=True)
    budget = 3600.0  # the whole run; each phase of a stage is bounded by cfg.stage_limit_s
    if torchrun:
        gathered = launch.run_here(worker, (cfg,), timeout_s=cfg.collective_timeout_s)
        if gathered is None:
            return 0  # not rank 0: rank 0 reports
    else:
        preload(cfg.gpu)
        try:
            gathered = launch.spawn(worker, cfg.world, (cfg,), timeout_s=budget,
                                    collective_timeout_s=cfg.collective_timeout_s)
        except RuntimeError as e:  # a rank died outside any stage (e.g. setting up megatron-core)
            last = [line for line in str(e).splitlines() if line.strip()][-1]
            report = os.path.join(cfg.out, "selftest.md")
            so_far = f" (report so far: {report})" if os.path.exists(report) else " (no stage had ended)"
            print(f"megatron-dualpipe: error: the selftest's processes stopped: {last.strip()}{so_far}",
                  file=sys.stderr, flush=True)
            return 1
    results = gathered[0]
    failed = [r["stage"] for r in results if r["status"] == "FAIL"]
    print(f"selftest {'FAILED: ' + ', '.join(failed) if failed else 'passed'} in "
          f"{time.perf_counter() - started:.0f} s; report: {os.path.join(cfg.out, 'selftest.md')}", flush=True)
    return 1 if failed else 0

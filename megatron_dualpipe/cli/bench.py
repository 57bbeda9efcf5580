"""``megatron-dualpipe bench``: the executor on synthetic stages against the simulator (and
``torch.distributed.pipelining`` with ``--peer torch``), with its own processes or under torchrun. Stages sleep
their F, B and W times by default, so that pp processes on a few cores measure the schedule and the
communication, not the cores. Only the arguments here (no torch import): the work is
:mod:`megatron_dualpipe.bench.measure`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Tuple

from ..schedule import build_schedule, registry
from ..schedule.simulate import Costs
from .args import Command, fused_cost_problem

HELP = "time the executor on synthetic stages against the simulator (and torch's schedules)"
#: The schedules the executor runs (the registry's); ``executor-1f1b`` is the 1F1B order.
SCHEDULE_NAMES = registry.names(runs_on=registry.EXECUTOR)


def _microbatches(text: str):
    """``8`` or ``2pp`` (a multiple of the pipeline size)."""
    t = text.strip().lower()
    try:
        k = int(t[:-2] or "1") if t.endswith("pp") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"micro-batches must be a number or a multiple of pp like 2pp, "
                                         f"got {text!r}") from None
    return (lambda pp: k * pp) if t.endswith("pp") else (lambda pp: k)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", nargs="+", default=list(SCHEDULE_NAMES), metavar="NAME",
                   help=f"schedules to run (default: {' '.join(SCHEDULE_NAMES)})")
    p.add_argument("--pp", nargs="+", type=int, default=None, metavar="P",
                   help="pipeline sizes (default 4; under torchrun: the world size)")
    p.add_argument("-m", "--microbatches", nargs="+", type=_microbatches, default=None, metavar="M",
                   help="micro-batches per iteration: numbers or multiples of pp (default: 2pp 4pp)")
    g = p.add_argument_group("stage costs in milliseconds")
    g.add_argument("--f", type=float, default=20.0, help="forward (default 20)")
    g.add_argument("--b", type=float, default=40.0, help="full backward, input + weight gradients (default 40)")
    g.add_argument("--w", type=float, default=20.0, help="weight-gradient part of b (default 20)")
    g.add_argument("--fb", type=float, default=None, help="a fused F&B unit (default f+b: no overlap gain)")
    p.add_argument("--compute", choices=("sleep", "matmul"), default="sleep",
                   help="how a stage spends its cost (default sleep; matmul for GPUs)")
    p.add_argument("--matmul-size", type=int, default=1024, help="matrix side for --compute matmul")
    p.add_argument("--shape", default="8,1024", help="activation shape passed between stages (default 8,1024)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (>= 5 for a spread; default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    p.add_argument("--peer", choices=("torch",), default=None,
                   help="also run torch.distributed.pipelining's Schedule1F1B, ScheduleDualPipeV and "
                        "ScheduleZBVZeroBubble on the same stages")
    p.add_argument("--channel-groups", action="store_true",
                   help="carry each channel (a direction between two ranks) on its own two-rank process group "
                        "(own NCCL stream) instead of batches on the pipeline group")
    p.add_argument("--grad-mb", type=float, default=0.0, metavar="MIB",
                   help="synthetic weight gradients per chunk that two-copy schedules (dualpipe) sum over the bd "
                        "pair, started as each chunk finishes, as in training; reports the exposed part "
                        "(default 0: none)")
    p.add_argument("--param-gather-mb", type=float, default=0.0, metavar="MIB",
                   help="instead of the comparison: run each schedule on two data-parallel replicas (2 x pp "
                        "processes) with MIB of synthetic parameters per chunk all-gathered before the chunk's "
                        "first forward (--overlap-param-gather with the distributed optimizer), without gathers, "
                        "started by the first forward's pre-hook, and started before the first action "
                        "(param_sync_func); prints the exposed gather time of each (default 0: off)")
    p.add_argument("--timeout", type=float, default=120.0, help="P2P timeout in seconds (default 120)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="record the timed iterations of the project's runs into DIR/SCHEDULE_ppP_mM/ "
                        "(draw them with: megatron-dualpipe trace DIR/SCHEDULE_ppP_mM --png t.png)")


#: Longest cost of one action (ms) the benchmark accepts: a minute.
MAX_COST_MS = 60_000.0
#: Pipeline ranks the benchmark starts on one machine: this many per core (beyond, start-up takes minutes).
PROCESSES_PER_CORE = 4
MIN_LOCAL_PROCESSES = 16
#: Why DualPipeV's rows show about twice the others' time.
V_NOTE = ("dualpipev runs two chunks per rank, each at the stage costs given, i.e. a model of 2*pp stages: about "
          "twice the work of the other rows (`megatron-dualpipe simulate` compares on one model, chunks at half "
          "a stage)")


def _config(args, pps: List[int]):
    from ..bench import launch
    from ..bench.measure import BenchConfig
    from ..bench.synthetic import StageCosts
    from ..bench.torch_peer import TORCH_SCHEDULES

    Costs(f=args.f, b=args.b, w=args.w, fb=args.fb)  # validates, naming the flag
    longest = max(args.f, args.b, args.fb or 0.0)
    if problem := fused_cost_problem(args.f, args.b, args.w, args.fb):
        raise ValueError(problem)
    if longest > MAX_COST_MS:  # the stages really spend these milliseconds
        raise ValueError(f"bench costs are milliseconds each stage really spends: at most {MAX_COST_MS:g} per "
                         f"action, got {longest:g}")
    for flag, mb in (("--grad-mb", args.grad_mb), ("--param-gather-mb", args.param_gather_mb)):
        if not mb >= 0 or mb > 4096:
            raise ValueError(f"{flag} must be between 0 and 4096 MiB, got {mb:g}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"--shape must be two positive integers like 8,1024, got {args.shape!r}") from None
    local_limit = max(MIN_LOCAL_PROCESSES, PROCESSES_PER_CORE * (os.cpu_count() or 1))
    processes = max(pps) * (2 if args.param_gather_mb else 1)
    if not launch.under_torchrun() and processes > local_limit:
        raise ValueError(f"--pp {max(pps)} starts {processes} processes on this machine ({os.cpu_count()} cores), "
                         f"each sleeping its stage costs: at most {local_limit} here; run larger pipelines under "
                         f"torchrun across machines (torchrun --nproc-per-node N -m megatron_dualpipe bench)")
    ms = args.microbatches or [_microbatches("2pp"), _microbatches("4pp")]
    per_pp: Dict[int, Tuple[int, ...]] = {}
    for pp in pps:
        per_pp[pp] = tuple(dict.fromkeys(f(pp) for f in ms))
        for m in per_pp[pp]:
            for name in args.schedule:
                build_schedule(name, pp, m)  # a ScheduleError names what would work
            if args.peer and m < 2 * pp:
                raise ValueError(f"torch's ScheduleDualPipeV needs M >= 2*pp = {2 * pp}, got M={m} at pp={pp}: "
                                 f"use -m 2pp or more, or leave out --peer")
    return BenchConfig(schedules=tuple(args.schedule), microbatches=per_pp,
                       costs=StageCosts(args.f, args.b, args.w, args.fb), mode=args.compute,
                       matmul_size=args.matmul_size, shape=shape, iters=args.iters, warmup=args.warmup,
                       peers=tuple(TORCH_SCHEDULES) if args.peer == "torch" else (), timeout_s=args.timeout,
                       trace_dir=os.path.abspath(args.trace) if args.trace else None,
                       per_channel=args.channel_groups, grad_mb=args.grad_mb, param_gather_mb=args.param_gather_mb)


def _ranks(worker, cfg, world: int, torchrun: bool, what: str, runs: str):
    """Every rank's result of ``worker`` (None on a torchrun rank but 0: rank 0 prints)."""
    from ..bench import launch

    print(f"bench: {what}: {'this rank of torchrun' if torchrun else f'starting {world} processes'}, {runs} of "
          f"{cfg.warmup} + {cfg.iters} iterations", file=sys.stderr, flush=True)
    if torchrun:
        return launch.run_here(worker, (cfg,), timeout_s=cfg.timeout_s + 60)
    return launch.spawn(worker, world, (cfg,), timeout_s=1800)


def _run_param_gathers(cfg, pps: List[int], torchrun: bool) -> int:
    """``--param-gather-mb``: the exposed parameter all-gathers (:mod:`..bench.param_gather`)."""
    from ..bench import param_gather

    for pp in pps:
        runs = f"{len(cfg.microbatches[pp]) * len(cfg.schedules)} x 3 runs"
        ranks = _ranks(param_gather.worker, cfg, 2 * pp, torchrun, f"pp={pp}, 2 replicas", runs)
        if ranks is None:
            return 0
        env = {"backend": ranks[0]["backend"], "device": ranks[0]["device"]}
        print(param_gather.table(param_gather.summary(ranks, pp), cfg.param_gather_mb, env))
    return 0


def run(args) -> int:
    from ..bench import launch, report
    from ..bench.measure import worker

    torchrun = launch.under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else None
    replicas = 2 if args.param_gather_mb else 1
    pps = args.pp or ([world // replicas] if torchrun else [4])
    if torchrun and [pp * replicas for pp in pps] != [world]:
        raise ValueError(f"under torchrun the world is {'two pipelines' if replicas == 2 else 'the pipeline'}: "
                         f"--pp must be {world // replicas}, got {' '.join(map(str, pps))}; start one torchrun per "
                         f"pipeline size")
    cfg = _config(args, pps)
    if cfg.param_gather_mb:
        return _run_param_gathers(cfg, pps, torchrun)
    latencies, all_rows, env = {}, [], {}
    for pp in pps:
        runs = len(cfg.microbatches[pp]) * len(cfg.schedules) * (1 + len(cfg.peers))
        ranks = _ranks(worker, cfg, pp, torchrun, f"pp={pp}", f"{runs} run{'s' if runs != 1 else ''}")
        if ranks is None:
            return 0
        latencies[pp], got = report.rows(cfg, pp, ranks)
        all_rows.extend(got)
        env = {"backend": ranks[0]["backend"], "device": ranks[0]["device"], "cores": os.cpu_count(),
               "matmuls_per_ms": ranks[0]["matmuls_per_ms"] or None}
    if args.json:
        print(json.dumps(report.to_json(cfg, latencies, all_rows, env)))
    else:
        print(report.table(cfg, latencies, all_rows, env))
        if any(r.schedule == registry.DUALPIPEV for r in all_rows):
            print(f"\nnote: {V_NOTE}")
    return 0


COMMAND = Command("bench", HELP, configure, run)

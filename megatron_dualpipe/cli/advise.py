"""``megatron-dualpipe advise``: the command line of :func:`megatron_dualpipe.costs.advice.advise`."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from typing import List

from ..apps.progress import Progress
from ..costs.advice import advise
from ..costs.compare import fmt
from ..costs.model_cost import GB
from ..schedule.registry import (DUALPIPE, DUALPIPEV, INTERLEAVED_1F1B, INTERLEAVED_1F1B_A2A, MEGATRON, MODELLED_SPECS,
                                 ONE_F_ONE_B, distinct_orders, interleaved_name)
from ..schedule.registry import spec as get
from . import advise_model
from .args import CliError, Command, add_comm_args, add_cost_args, comm_from_args, costs_from_args
from .build import MAX_FORWARDS

HELP = ("which schedule to use, for measured stage costs and memory or for a model's shape on a GPU kind "
        "(bubble, activations, parameters per schedule)")
MAX_COUNTS = 16


def parse_counts(text: str) -> List[int]:
    """``16`` | ``8,12,16`` | ``8:64`` (8, 16, 32, 64: doubling) | ``8:64:8`` (step 8)."""
    try:
        if ":" in text:
            parts = [int(x) for x in text.split(":")]
            if len(parts) not in (2, 3) or parts[0] < 1 or parts[1] < parts[0] or (len(parts) == 3 and parts[2] < 1):
                raise ValueError
            lo, hi, *step = parts
            counts = list(range(lo, hi + 1, step[0])) if step else [lo << k for k in range(hi.bit_length())
                                                                    if lo << k < hi] + [hi]
        else:
            counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise CliError(f"--microbatches {text!r}: give a count (16), a list (8,12,16), a doubling range (8:64) "
                       f"or a range with a step (8:64:8), all positive") from None
    if any(m < 1 for m in counts):
        raise CliError(f"--microbatches {text!r}: counts must be positive")
    if len(counts) > MAX_COUNTS:
        raise CliError(f"--microbatches {text!r} gives {len(counts)} counts, more than {MAX_COUNTS}: use a larger step")
    return sorted(set(counts))


def configure(p) -> None:
    p.add_argument("--pp", type=int, metavar="P", help="pipeline-parallel size (ranks; measured costs)")
    p.add_argument("--microbatches", "-m", metavar="RANGE",
                   help="micro-batches per iteration: 16, 8,12,16, 8:64 (doubling) or 8:64:8 (measured costs)")
    add_cost_args(p, "measured costs of one pipeline stage per micro-batch, as 1F1B runs it (any time unit)",
                  defaults=False)
    g = p.add_argument_group("memory per rank (any unit, the same for all; measured costs)")
    g.add_argument("--activation-memory", type=float, metavar="X", help="activations of one micro-batch on one stage")
    g.add_argument("--parameter-memory", type=float, metavar="X",
                   help="one stage's parameters with their gradients and optimizer state")
    g.add_argument("--weight-grad-memory", type=float, default=0.0, metavar="X",
                   help="what one deferred weight gradient keeps alive until its W runs (default 0: not counted)")
    g.add_argument("--memory-limit", type=float, default=None, metavar="X",
                   help="memory per rank (default: none; for a model the GPU's HBM in GB)")
    p.add_argument("--schedules", metavar="NAMES", help="comma-separated subset (default: one per distinct order: "
                   + ", ".join(distinct_orders()) + ")")
    p.add_argument("--virtual-pipeline", type=int, default=2, metavar="V",
                   help="virtual pipeline size of the interleaved 1F1B incumbents (default 2)")
    p.add_argument("--tokens", type=float, default=None, metavar="T",
                   help="tokens of one micro-batch the costs are for: the break-even is then said in tokens")
    add_comm_args(p)
    p.set_defaults(intra_bw=None, inter_bw=None, dp=None, tp=None)  # measured: 200, 25, 1, 1; a model: its own
    p.add_argument("--json", action="store_true", help="print the advice as JSON")
    p.add_argument("--launch-check", action="store_true", help="(the launch script's) one line on the model's "
                   "--pipeline-schedule: exit 3 when it does not fit the GPU's memory, naming one that does")
    advise_model.configure(p)


#: The measured-cost path's flags without a default, and the defaults of the shared communication flags.
MEASURED = (("--pp", "pp"), ("--microbatches", "microbatches"), ("--f", "f"), ("--b", "b"), ("--w", "w"),
            ("--activation-memory", "activation_memory"), ("--parameter-memory", "parameter_memory"))
COMM_DEFAULTS = {"intra_bw": 200.0, "inter_bw": 25.0, "dp": 1, "tp": 1}
#: What a model sets itself: measured flags given with one are refused, not ignored.
MODEL_SETS = (("--stage-params", "stage_params"), ("--message-bytes", "message_bytes"), ("--dp", "dp"), ("--tp", "tp"))


def run(args) -> int:
    if args.config or args.model_args or args.gpu:
        given = [flag for flag, name in MEASURED + MODEL_SETS if getattr(args, name) is not None]
        # the model's own --use-distributed-optimizer / --overlap-grad-reduce (after --) set these
        given += [flag for flag, on in (("--distributed-optimizer", args.distributed_optimizer),
                                        ("--no-overlap-grad-reduce", not args.overlap_grad_reduce)) if on]
        if given:
            raise CliError(f"{', '.join(given)}: advise takes measured costs or a model (--config, --gpu, "
                           f"pretrain_gpt.py arguments after --), not both: drop {' '.join(given)}")
        return _run_model(args)
    missing = [flag for flag, name in MEASURED if getattr(args, name) is None]
    if missing:
        raise CliError(f"the measured costs are required: {', '.join(missing)}; or give a model: --config NAME and/or "
                       f"pretrain_gpt.py arguments after --, with --gpu and --nodes")
    for name, value in COMM_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return _run_measured(args)


def _run_model(args) -> int:
    s, advice, dropped, extra = model_advice(args)
    if args.launch_check:
        return launch_check(s, advice)
    print(json.dumps(dict(advice.to_json(), model=s.lines, not_compared=dropped, overlap=extra)) if args.json else
          "\n".join(s.lines + ([f"not compared: {'; '.join(dropped)}"] if dropped else []) + extra
                    + ["", "times in ms per iteration or micro-batch, memory in GB per GPU", advice.format()]))
    return 0


def model_advice(args):
    """(setup, advice, schedules not compared, the all-to-all overlap's line) for the model of ``args``."""
    s = advise_model.setup(args)
    m = s.model
    names, dropped = _model_schedules(args, m)
    limit = args.memory_limit if args.memory_limit is not None else s.gpu.hbm_gb
    mem = s.memory
    run = dict(activation_memory=mem.activations / GB, parameter_memory=mem.states / GB, memory_limit=limit,
               weight_grad_memory=args.weight_grad_memory, comm=advise_model.comm(args, s),
               tokens=m.micro_batch * m.seq_length, num_layers=m.num_layers, optimizer_memory=mem.optimizer / GB,
               once_memory=mem.activations_once / GB, shared_optimizer=m.shared_shard,
               no_fit_hint=advise_model.no_fit_hint(m, limit), details=not args.launch_check)
    costs = s.costs if m.a2a_overlap else replace(s.costs, fb=None)
    advice = _simulate(m.pp, [s.microbatches], costs, [n for n in names if m.a2a_overlap or not _a2a(n)], **run)
    extra = []
    if m.num_experts and m.ep > 1 and not m.a2a_overlap and not args.launch_check:  # the gate: the run's own row
        dropped += [f"{n} (needs --overlap-moe-expert-parallel-comm: below)" for n in names if _a2a(n)]
        extra = [advise_model.overlap_line(m, advice, _simulate(m.pp, [s.microbatches], s.costs, names, **run))]
    return s, advice, dropped, extra


def _names(args) -> List[str]:
    """``--schedules``, or one schedule per distinct order."""
    return [get(n).name for n in args.schedules.split(",")] if args.schedules else list(distinct_orders())


def _a2a(name: str) -> bool:
    return name.startswith(INTERLEAVED_1F1B_A2A)


def _model_schedules(args, m):
    """The schedules advise compares for model ``m``, and those it cannot (with why): those whose stages do not
    split the layers (evenly, or as the model's --decoder-first/last-pipeline-num-layers or layout say: 1f1b's
    and dualpipe's pp stages, and dualpipev's V-stages, which a layout of pp stages cut in two gives)."""
    # interleaved 1F1B: the model's own virtual pipeline (--num-layers-per-virtual-pipeline-stage), else ours
    per = m.layers_per_virtual_stage
    v = (m.num_layers // (m.pp * per) or None) if per else args.virtual_pipeline
    names = [interleaved_name(n, v) if n in MODELLED_SPECS else n for n in _names(args) if n not in MODELLED_SPECS or v]
    uneven = m.first_stage_layers is not None or m.last_stage_layers is not None or m.layout is not None
    dropped = []
    for n in names:
        stages = get(n).model_stages(m.pp)
        if uneven and n not in (ONE_F_ONE_B, DUALPIPE, DUALPIPEV):
            dropped.append(f"{n} (uneven stages are taken by 1f1b, dualpipe and dualpipev only)")
        elif not uneven and m.num_layers % stages:
            dropped.append(f"{n} ({m.num_layers} layers do not split into {stages} stages)")
    if not (m.num_experts and m.ep > 1):  # Megatron refuses --overlap-moe-expert-parallel-comm without EP
        dropped += [f"{n} (its overlap is MoE expert parallel's all-to-all: the model has none)" for n in names
                    if _a2a(n)]
    if m.offload:  # the plugin refuses it: its handlers are advanced by Megatron's own schedules
        dropped += [f"{n} (refuses --fine-grained-activation-offloading: Megatron's own schedules run it)"
                    for n in names if get(n).runs_on != MEGATRON and not n.startswith("interleaved")]
    names = [n for n in names if not any(d.startswith(n + " ") for d in dropped)]
    if not names:
        raise CliError("no schedule splits the model's layers: " + "; ".join(dropped))
    return names, dropped


def _simulate(pp, counts, costs, names, **kw):
    """:func:`advise` for ``names``, refusing what would take minutes to simulate or overflows."""
    biggest = max(get(n).model_stages(pp) * max(counts) for n in names)
    if biggest > MAX_FORWARDS:
        raise CliError(f"pp={pp} with M={max(counts)} simulates {biggest} forward actions, more than the limit "
                       f"of {MAX_FORWARDS}: the bubble and peak memory stop changing once M >= 2*pp, so use "
                       f"smaller micro-batch counts (for a model: a smaller --global-batch-size)")
    with Progress(f"advise pp={pp}") as prog:
        prog.phase(f"simulating {len(names)} schedules x {len(counts)} micro-batch counts")
        advice = advise(pp, counts, costs, names=names, **kw)
    if any(not math.isfinite(o.row.makespan) for ch in advice.choices for o in ch.options):
        raise CliError("the costs are too large: the simulated time overflows; use smaller values or units")
    return advice


def _run_measured(args) -> int:
    if args.pp < 1:
        raise CliError(f"--pp must be a positive integer, got {args.pp}")
    if args.virtual_pipeline < 2:
        raise CliError(f"--virtual-pipeline must be >= 2, got {args.virtual_pipeline}")
    if args.tokens is not None and not (math.isfinite(args.tokens) and args.tokens > 0):
        raise CliError(f"--tokens must be a positive number, got {args.tokens}")
    counts = parse_counts(args.microbatches)
    names = [interleaved_name(n, args.virtual_pipeline) if n in MODELLED_SPECS else n for n in _names(args)]
    advice = _simulate(args.pp, counts, costs_from_args(args), names, activation_memory=args.activation_memory,
                       parameter_memory=args.parameter_memory, memory_limit=args.memory_limit, tokens=args.tokens,
                       weight_grad_memory=args.weight_grad_memory, comm=comm_from_args(args, args.pp))
    print(json.dumps(advice.to_json()) if args.json else advice.format())
    return 0


#: Exit status of a launch whose schedule does not fit.
DOES_NOT_FIT = 3


def launch_check(s, advice) -> int:
    """``--launch-check``: the launch script's memory gate before torchrun, one line: a schedule that does not
    fit the GPU's memory is refused (exit 3) naming the fastest that fits. ``s``: ``advise_model.Setup``."""
    ch = advice.choices[0]
    rows, m = {o.row.name: o for o in ch.options if not o.row.problem}, s.model
    name = m.schedule  # the run's row: Megatron's 1f1b with a virtual pipeline is interleaved
    if m.schedule == ONE_F_ONE_B and m.layers_per_virtual_stage:
        kind = INTERLEAVED_1F1B_A2A if m.a2a_overlap else INTERLEAVED_1F1B
        name = next((n for n in rows if n.startswith(kind)), kind)
    mine = rows.get(name)
    best = rows.get(ch.best) if ch.best else None
    limit = fmt(advice.memory_limit)
    if mine is None:
        print(f"advise: {name} is not modelled; no memory estimate")
        return 0
    where = f"{fmt(mine.memory)} GB per GPU by advise's estimate (limit {limit} GB, GPU={s.gpu.name})"
    if not mine.fits:
        fix = (f"use SCHEDULE={best.row.name} ({fmt(best.memory)} GB, fits)" if best is not None else
               ch.reason[ch.reason.find("try "):] if "try " in ch.reason else "no schedule fits")
        print(f"advise: error: SCHEDULE={name} needs {where}: {fix}; or set MEMORY_CHECK=0 to launch anyway",
              file=sys.stderr)
        return DOES_NOT_FIT
    if best is not None and best is not mine:
        gain = 100 * (mine.row.iteration - best.row.iteration) / mine.row.iteration
        print(f"advise: SCHEDULE={name} fits ({where}); {best.row.name} would be {gain:.1f}% shorter per iteration "
              f"({fmt(best.row.iteration)} ms against {fmt(mine.row.iteration)}) and fits ({fmt(best.memory)} GB)")
    else:
        print(f"advise: SCHEDULE={name} fits ({where}) and is the fastest that fits")
    return 0


COMMAND = Command("advise", HELP, configure, run)

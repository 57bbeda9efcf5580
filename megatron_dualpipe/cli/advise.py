"""``megatron-dualpipe advise``: the command line of :func:`megatron_dualpipe.schedule.advice.advise`."""
from __future__ import annotations

import math
from typing import List

from ..schedule.advice import advise
from ..schedule.registry import distinct_orders
from ..schedule.registry import spec as get

HELP = "which schedule to use for measured stage costs and memory (bubble, activations, parameters per schedule)"


MAX_COUNTS = 16


def parse_counts(text: str) -> List[int]:
    """``16`` | ``8,12,16`` | ``8:64`` (8, 16, 32, 64: doubling) | ``8:64:8`` (step 8)."""
    from .args import CliError

    try:
        if ":" in text:
            parts = [int(x) for x in text.split(":")]
            if len(parts) not in (2, 3) or parts[0] < 1 or parts[1] < parts[0] or (len(parts) == 3 and parts[2] < 1):
                raise ValueError
            lo, hi = parts[0], parts[1]
            if len(parts) == 3:
                counts = list(range(lo, hi + 1, parts[2]))
            else:
                counts, m = [], lo
                while m < hi:
                    counts.append(m)
                    m *= 2
                counts.append(hi)
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
    from .args import add_cost_args
    from .schedule import add_comm_args

    p.add_argument("--pp", required=True, type=int, metavar="P", help="pipeline-parallel size (ranks)")
    p.add_argument("--microbatches", "-m", required=True, metavar="RANGE",
                   help="micro-batches per iteration: 16, 8,12,16, 8:64 (doubling) or 8:64:8")
    add_cost_args(p, "measured costs of one pipeline stage per micro-batch, as 1F1B runs it (any time unit)",
                   defaults=False)
    g = p.add_argument_group("memory per rank (any unit, the same for all)")
    g.add_argument("--activation-memory", type=float, required=True, metavar="X",
                   help="activations of one micro-batch on one stage")
    g.add_argument("--parameter-memory", type=float, required=True, metavar="X",
                   help="one stage's parameters with their gradients and optimizer state")
    g.add_argument("--weight-grad-memory", type=float, default=0.0, metavar="X",
                   help="what one deferred weight gradient keeps alive until its W runs (default 0: not counted)")
    g.add_argument("--memory-limit", type=float, default=None, metavar="X", help="memory per rank (default: none)")
    p.add_argument("--schedules", metavar="NAMES", help="comma-separated subset (default: one per distinct order: "
                   + ", ".join(distinct_orders()) + ")")
    p.add_argument("--virtual-pipeline", type=int, default=2, metavar="V",
                   help="virtual pipeline size of the interleaved 1F1B incumbents (default 2)")
    p.add_argument("--tokens", type=float, default=None, metavar="T",
                   help="tokens of one micro-batch the costs are for: the break-even is then said in tokens")
    add_comm_args(p)
    p.add_argument("--json", action="store_true", help="print the advice as JSON")


def run(args) -> int:
    import json

    from .args import CliError, costs_from_args
    from .schedule import MAX_FORWARDS, comm_from_args
    from ..apps.progress import Progress
    from ..schedule.registry import MODELLED_SPECS, interleaved_name

    if args.pp < 1:
        raise CliError(f"--pp must be a positive integer, got {args.pp}")
    if args.virtual_pipeline < 2:
        raise CliError(f"--virtual-pipeline must be >= 2, got {args.virtual_pipeline}")
    if args.tokens is not None and not (math.isfinite(args.tokens) and args.tokens > 0):
        raise CliError(f"--tokens must be a positive number, got {args.tokens}")
    counts = parse_counts(args.microbatches)
    names = [get(n).name for n in args.schedules.split(",")] if args.schedules else list(distinct_orders())
    names = [interleaved_name(n, args.virtual_pipeline) if n in MODELLED_SPECS else n for n in names]
    costs = costs_from_args(args)
    comm = comm_from_args(args, args.pp)
    biggest = max(get(n).model_stages(args.pp) * max(counts) for n in names)
    if biggest > MAX_FORWARDS:
        raise CliError(f"pp={args.pp} with M={max(counts)} simulates {biggest} forward actions, more than the limit "
                       f"of {MAX_FORWARDS}: the bubble and peak memory stop changing once M >= 2*pp, so use "
                       f"smaller micro-batch counts")
    with Progress(f"advise pp={args.pp}") as prog:
        prog.phase(f"simulating {len(names)} schedules x {len(counts)} micro-batch counts")
        advice = advise(args.pp, counts, costs, args.activation_memory, args.parameter_memory, args.memory_limit,
                        args.weight_grad_memory, names, comm, args.tokens)
    if any(not math.isfinite(o.row.makespan) for ch in advice.choices for o in ch.options):
        raise CliError("the costs are too large: the simulated time overflows; use smaller values or units")
    print(json.dumps(advice.to_json()) if args.json else advice.format())
    return 0

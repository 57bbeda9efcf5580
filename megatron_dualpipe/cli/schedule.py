"""``megatron-dualpipe schedule`` and ``simulate``: build a schedule, print it, time it, draw it.

Both build what the executor runs: a micro-batch count the order cannot take on its own
(DualPipe: odd, or below 2*pp) is padded with fake micro-batches, as in training, unless
``--no-pad``. Sizes are bounded (:data:`MAX_FORWARDS`) so that every accepted command ends in
seconds, with progress on stderr past a second.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import List, Optional

from .args import CliError, add_cost_args, add_schedule_args, check_writable, costs_from_args, write_output
from ..apps.progress import Progress
from ..schedule.compare import fmt, table

#: Largest schedule built: forward actions (micro-batches x model stages, fakes included). At
#: this size the simulator takes a few seconds; a larger M only lengthens the steady state,
#: while the bubble and the peak memory stop changing once M >= 2*pp.
MAX_FORWARDS = 65536


def add_comm_args(p: argparse.ArgumentParser) -> None:
    """The gradient communication and P2P links (``schedule.comm_cost``); costs are then ms."""
    g = p.add_argument_group("communication (with --stage-params or --message-bytes: costs are in ms; "
                             "the iteration is the makespan plus the exposed gradient communication)")
    g.add_argument("--stage-params", type=float, default=None, metavar="N",
                   help="parameters of one pipeline stage on one rank (after tensor parallel)")
    g.add_argument("--grad-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="gradient dtype of the reductions (default fp32, Megatron's main grads)")
    g.add_argument("--message-bytes", type=float, default=None, metavar="BYTES",
                   help="one P2P message: a micro-batch's activation (or its gradient) between stages")
    g.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size, for the rank placement (default 1)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default 8)")
    g.add_argument("--placement", choices=("megatron", "paired"), default="megatron",
                   help="megatron: Megatron's rank order (tp, dp, pp) on nodes of consecutive ranks; paired: what "
                        "the launcher's --pair-placement (PAIR_PLACEMENT=1) does for dualpipe, pipeline ranks i and "
                        "pp-1-i on one node (other schedules stay in Megatron's placement)")
    g.add_argument("--intra-bw", type=float, default=200.0, metavar="GB/s",
                   help="bandwidth per rank inside a node (default 200)")
    g.add_argument("--inter-bw", type=float, default=25.0, metavar="GB/s",
                   help="bandwidth per rank between nodes (default 25)")
    g.add_argument("--intra-latency", type=float, default=0.01, metavar="MS", help="default 0.01")
    g.add_argument("--inter-latency", type=float, default=0.02, metavar="MS", help="default 0.02")
    g.add_argument("--distributed-optimizer", action="store_true",
                   help="the data-parallel reduction is a reduce-scatter (Megatron's distributed optimizer)")
    g.add_argument("--bd-reduction", choices=("bd-first", "dp-first", "shared-shard"), default="bd-first",
                   help="how DualPipe's two copies of a stage meet data parallel: bd-first (what the executor does), "
                        "dp-first (training's --dualpipe-dp-first: reduce-scatter over dp, then the pair sums the 1/dp shards after the "
                        "schedule; needs --distributed-optimizer to carry less), or shared-shard (one reduce-scatter over 2 x dp; needs "
                        "--distributed-optimizer; training's --dualpipe-shared-shard-group, which reduces after the "
                        "schedule: model it with --no-overlap-grad-reduce)")
    g.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                   help="Megatron's own schedules reduce after the pipeline (no --overlap-grad-reduce)")


def comm_from_args(args, pp: int):
    """The :class:`~.schedule.comm_cost.CommModel` of ``args``, or None when neither gradients nor
    messages were given (then P2P costs ``--p2p`` and gradients nothing)."""
    from ..schedule.comm_cost import DTYPE_BYTES, CommModel, Link, Network, Placement

    if args.stage_params is None and args.message_bytes is None:
        return None
    for flag, v in (("--stage-params", args.stage_params), ("--message-bytes", args.message_bytes)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise CliError(f"{flag} must be a finite number >= 0, got {v}")
    for flag, v in (("--dp", args.dp), ("--tp", args.tp), ("--gpus-per-node", args.gpus_per_node)):
        if v < 1:
            raise CliError(f"{flag} must be a positive integer, got {v}")
    try:
        network = Network(Link(args.intra_bw, args.intra_latency), Link(args.inter_bw, args.inter_latency))
    except ValueError as e:
        raise CliError(f"--intra-bw/--inter-bw/--intra-latency/--inter-latency: {e}") from None
    if args.bd_reduction == "shared-shard" and not args.distributed_optimizer:
        raise CliError("--bd-reduction shared-shard shards the distributed optimizer's state over both copies: add "
                       "--distributed-optimizer")
    try:
        placement = Placement(pp, args.dp, args.tp, args.gpus_per_node, args.placement == "paired")
    except ValueError as e:
        raise CliError(f"--placement {args.placement}: {e}") from None
    return CommModel(placement, network,
                     (args.stage_params or 0.0) * DTYPE_BYTES[args.grad_dtype], args.message_bytes or 0.0,
                     args.distributed_optimizer, args.overlap_grad_reduce, bd_mode=args.bd_reduction)


def add_stage_cost_args(p: argparse.ArgumentParser) -> None:
    """Uneven stages (``schedule.stage_pairs``): each stage's cost, or a layout priced per layer."""
    g = p.add_argument_group("uneven stages (which stages each rank holds under 1F1B, DualPipe and DualPipeV, and "
                             "their summed cost)")
    g.add_argument("--stage-costs", metavar="C0,C1,...", help="each stage's cost per micro-batch: pp values (a "
                   "stage's V-stages then cost half each) or 2*pp (DualPipeV's V-stages); 3,4*14,5 repeats 4")
    g.add_argument("--layout", metavar="LAYOUT", help="Megatron's --pipeline-model-parallel-layout of pp or 2*pp "
                   "stages (E embedding, t layer, m MTP, L output layer and loss), priced by --layer-costs")
    g.add_argument("--layer-costs", metavar="E=0,t=1,m=1,L=0", default="",
                   help="cost of each layout letter (default t=1, m=1, E=0, L=0)")


def stage_cost_views(args, pp: int):
    """(pp stage costs, 2pp V-stage costs) of ``--stage-costs`` or ``--layout``, or None."""
    from ..schedule import stage_pairs
    from ..schedule.stage_layout import LayoutError

    if args.stage_costs is not None and args.layout is not None:
        raise CliError("--stage-costs and --layout both price the stages: give one")
    if args.layer_costs and args.layout is None:
        raise CliError("--layer-costs prices the letters of a --layout: give --layout too")
    try:
        if args.stage_costs is not None:
            return stage_pairs.views(stage_pairs.parse_costs(args.stage_costs), pp)
        if args.layout is not None:
            layer_costs = stage_pairs.parse_layer_costs(args.layer_costs) if args.layer_costs else {}
            return stage_pairs.layout_costs(args.layout, layer_costs, pp)
    except (ValueError, LayoutError) as e:
        raise CliError(str(e)) from None
    return None


def stage_pairs_lines(views) -> List[str]:
    from ..schedule import registry, stage_pairs

    if views is None:
        return []
    return [""] + stage_pairs.report(*views, (registry.ONE_F_ONE_B, registry.DUALPIPE, registry.DUALPIPEV))


def _add_pad_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pad", dest="pad", action="store_true", default=True,
                   help="run a micro-batch count the order cannot take (DualPipe: odd, or below 2*pp) padded "
                        "with fake micro-batches, as training does (default)")
    p.add_argument("--no-pad", dest="pad", action="store_false", help="refuse such counts instead")


def build(args, progress: Optional[Progress] = None):
    """The (padded) schedule for ``args``, refusing sizes past :data:`MAX_FORWARDS` before building."""
    from ..schedule.padding import Padded
    from ..schedule.registry import ScheduleError, build_schedule
    from ..schedule.registry import spec as get

    spec = get(args.schedule)
    pp, m = args.pp, args.microbatches
    if pp < 1:
        raise CliError(f"pipeline size --pp must be a positive integer, got {pp}")
    if m < 1:
        raise CliError(f"number of micro-batches --microbatches must be a positive integer, got {m}")
    problem = spec.pp_problem(pp)
    if problem:
        raise ScheduleError(problem)
    if args.pad:
        least = spec.min_real_microbatches(pp)
        if m < least:
            raise CliError(f"{spec.name} needs at least {least} micro-batches with pp={pp} (with fewer, "
                           f"padding would fill most of the pipeline with fakes), got {m}: set --microbatches "
                           f"to {least} or more")
        run = spec.padded_microbatches(pp, m)
    else:
        problem = spec.microbatch_problem(pp, m)
        if problem:
            raise ScheduleError(problem + " (or drop --no-pad)")
        run = m
    forwards = spec.model_stages(pp) * run
    if forwards > MAX_FORWARDS:
        fit = MAX_FORWARDS // spec.model_stages(pp)
        raise CliError(f"{spec.name} pp={pp} M={m} has {forwards} forward actions (M x {spec.model_stages(pp)} "
                       f"model stages), more than the limit of {MAX_FORWARDS}: the bubble and peak memory stop "
                       f"changing once M >= 2*pp, so use --microbatches {fit} or fewer"
                       + ("" if fit >= spec.min_microbatches(pp) else " with a smaller --pp"))
    if progress:
        progress.phase(f"building {run} micro-batches x {pp} ranks")
    return Padded(build_schedule(spec.name, pp, run), m)


def _per_dir(s) -> str:
    counts = s.microbatches_per_direction()
    if len(counts) == 1:
        return f"{counts[0]} micro-batches"
    return ", ".join(f"{s.layout.dir_word} {d}: {n}" for d, n in sorted(counts.items()))


def _padding_note(padded) -> str:
    if not padded.fake_count:
        return ""
    return (f"{padded.real} micro-batches run as {padded.schedule.microbatches}: {padded.fake_count} fake "
            f"(padding, as in training: no data, no compute; --no-pad refuses instead)")


# ---------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------

def configure_schedule(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    _add_pad_args(p)
    p.add_argument("--json", action="store_true", help="print the per-rank action lists as JSON")


def run_schedule(args) -> int:
    from ..schedule import format_grid

    with Progress(f"schedule {args.schedule} pp={args.pp} M={args.microbatches}") as prog:
        padded = build(args, prog)
        s = padded.schedule
        if args.json:
            doc = s.to_json()
            if padded.fake_count:
                doc["real_microbatches"] = padded.real
            print(json.dumps(doc))
            return 0
        prog.phase("formatting")
        text = format_grid(s.ranks)
    layout = s.layout
    print(f"{s.name}: pp={s.pp} M={s.microbatches} ({layout.kind} layout; {_per_dir(s)})")
    note = _padding_note(padded)
    if note:
        print(note)
    two = len(layout.directions) > 1
    print("F forward, B input-grad backward, BW full backward, W deferred weight grad; "
          f"F0.3 = {layout.dir_word + ' 0, ' if two else ''}micro-batch 3; '+' = F fused with the backward after it"
          + (f"; {layout.dir_word}s: " + ", ".join(layout.dir_label(d) for d in layout.directions) if two else ""))
    print(text)
    return 0


# ---------------------------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------------------------

def _png_path(text: str) -> str:
    from .args import png_path

    return png_path(text)


def configure_simulate(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    _add_pad_args(p)
    add_cost_args(p, "costs (hypothetical time units; dualpipev: per chunk, half a stage)")
    add_comm_args(p)
    add_stage_cost_args(p)
    p.add_argument("--json", action="store_true",
                   help="print makespan, bubble, peak_activations, busy and the same-model comparison as JSON")
    p.add_argument("--png", metavar="FILE.png", type=_png_path, help="draw the timeline to a PNG (needs matplotlib)")
    p.add_argument("--svg", metavar="FILE", help="draw the timeline to an SVG")


#: The comparison simulates every schedule on the same model when their forward actions
#: together stay under this (otherwise it is skipped with a note).
COMPARE_BUDGET = 3 * MAX_FORWARDS


def _draw(args, padded, result, prog) -> list:
    """Write the --svg / --png pictures of the simulated run; returns the files written."""
    s, drawn = padded.schedule, []
    fake = padded.is_fake if padded.fake_count else None
    if args.svg:
        from ..pictures.draw import to_svg

        prog.phase(f"drawing {args.svg}")
        write_output(args.svg, to_svg(s, result, fake=fake))
        drawn.append(args.svg)
    if args.png:
        try:
            from ..pictures.draw import to_png

            prog.phase(f"drawing {args.png}")
            to_png(s, result, args.png, fake=fake)
        except ImportError:
            raise CliError("--png needs matplotlib: pip install matplotlib") from None
        except OSError as e:
            raise CliError(f"cannot write {args.png}: {e.strerror or e}") from None
        drawn.append(args.png)
    return drawn


def run_simulate(args) -> int:
    import sys

    from ..schedule.comm_cost import grad_comm
    from ..schedule.compare import compare, in_other_placement, orders_with, stage_fraction
    from ..schedule.registry import spec as get
    from ..schedule.simulate import DeadlockError, simulate

    costs = costs_from_args(args)
    comm = comm_from_args(args, args.pp)
    views = stage_cost_views(args, args.pp)
    for flag, path in (("--png", args.png), ("--svg", args.svg)):
        if path is not None:
            if not path.strip():
                raise CliError(f"{flag} needs a file name, got an empty one")
            check_writable(path)
    with Progress(f"simulate {args.schedule} pp={args.pp} M={args.microbatches}") as prog:
        padded = build(args, prog)
        s = padded.schedule
        prog.phase("simulating")
        try:
            result = simulate(s.layout, s.ranks, padded.costs(costs), prog.update,
                              p2p=comm.for_schedule(s.spec.mirrored).p2p if comm else None)
        except DeadlockError as e:  # cannot happen for built schedules; keep the promise of one line
            raise CliError(" ".join(line.strip() for line in str(e).splitlines()[:2])) from None
        if not math.isfinite(result.makespan):
            raise CliError(f"the costs are too large: the simulated time overflows ({result.makespan}); "
                           f"use smaller values or units")
        grad = None if comm is None else grad_comm(s, result, comm.for_schedule(s.spec.mirrored),
                                                   stage_fraction(s.spec, s.pp), s.spec.defers_weight_grads,
                                                   padded.is_fake)
        stage = costs.scaled(1 / stage_fraction(s.spec, s.pp))
        other = None
        if comm is not None and s.spec.mirrored:
            prog.phase("simulating the other rank placement")
            other = in_other_placement(s.name, s.pp, padded.real, stage, comm)
        names = orders_with(s.name)
        work = sum(_forwards(get(n), s.pp, padded.real) for n in names)
        rows = None
        if work <= COMPARE_BUDGET:
            prog.phase("simulating every schedule on the same model")
            rows = compare(s.pp, padded.real, stage, names, known={s.name: (padded, result)}, comm=comm)
        drawn = _draw(args, padded, result, prog)
    if drawn:
        from ..pictures.draw import frame

        note = frame(s, result).note
        print(f"wrote {' and '.join(drawn)}" + (f" ({note})" if note else ""), file=sys.stderr)
    if args.json:
        doc = dict(result.to_json(), schedule=s.name, pp=s.pp, microbatches=s.microbatches,
                   real_microbatches=padded.real,
                   gradient_communication=None if grad is None else {
                       "iteration": grad.iteration, "exposed_per_rank": grad.exposed,
                       "bd_sum_per_rank": grad.bd_total, "dp_reduce_per_rank": grad.dp_total},
                   other_placement=None if other is None else {
                       "placement": other[0], "iteration": None if other[1] is None else other[1].iteration,
                       "problem": other[2]},
                   same_model=None if rows is None else [r.to_json() for r in rows],
                   stage_costs=None if views is None else {"stages": views[0], "v_stages": views[1]})
        print(json.dumps(doc))
        return 0
    print("\n".join([_report(padded, costs, result, rows, stage, work, grad, other)] + stage_pairs_lines(views)))
    return 0


def _forwards(spec, pp: int, real: int) -> int:
    """Forward actions ``spec`` simulates for ``real`` micro-batches (0 where it cannot run)."""
    from ..schedule.registry import ScheduleError

    if spec.pp_problem(pp) or real < spec.min_real_microbatches(pp):
        return 0
    try:
        return spec.model_stages(pp) * spec.padded_microbatches(pp, real)
    except ScheduleError:
        return 0


def _other_placement_line(name: str, grad, other) -> str:
    """What the other rank placement does to a schedule with bd pairs (``compare.in_other_placement``)."""
    placement, row, problem = other
    if row is None:
        return f"placement: {name} cannot have its bd pairs on one node here: {problem}"
    how = ("--placement paired (the launcher's --pair-placement: bd pairs on one node)" if placement == "paired"
           else "--placement megatron (without --pair-placement)")
    return f"placement: with {how}: iteration {fmt(round(row.iteration, 3))} instead of {fmt(round(grad.iteration, 3))}"


def _report(padded, costs, result, rows, stage, work, grad=None, other=None) -> str:
    s = padded.schedule
    spec = s.spec
    share = spec.model_stages(s.pp) // s.pp  # chunks per stage's worth of model
    per = ("per chunk (half a stage)" if share == 2 else f"per chunk (1/{share} of a stage)") \
        if spec.costs_per_chunk else "per stage"
    unit = s.layout.dir_word + "s" if spec.costs_per_chunk else "micro-batches"
    lines: List[str] = [f"{s.name}: pp={s.pp} M={s.microbatches} ({_per_dir(s)})"]
    note = _padding_note(padded)
    if note:
        lines.append(note)
    lines.append(f"costs {per}: f={fmt(costs.f)} b={fmt(costs.b)} w={fmt(costs.w)} fb={fmt(costs.fused)} "
                 f"p2p={fmt(costs.p2p)}")
    lines.append(f"makespan {fmt(result.makespan)}")
    if grad is not None:
        lines.append(f"iteration {fmt(round(grad.iteration, 3))} = makespan + exposed gradient communication "
                     f"{fmt(round(grad.iteration - result.makespan, 3))} (largest over the ranks; ms)")
    if other is not None:
        lines.append(_other_placement_line(s.name, grad, other))
    lines.append("")
    head = f"peak activations ({unit})" if spec.costs_per_chunk else "peak activations"
    extra = f"  {'bd sum':>8}  {'dp reduce':>9}  {'exposed':>8}" if grad is not None else ""
    lines.append(f"{'rank':>4}  {'busy':>10}  {'bubble':>10}  {head:>16}{extra}")
    for r, tl in enumerate(result.ranks):
        more = (f"  {fmt(round(grad.bd_total[r], 3)):>8}  {fmt(round(grad.dp_total[r], 3)):>9}  "
                f"{fmt(round(grad.exposed[r], 3)):>8}") if grad is not None else ""
        lines.append(f"{r:>4}  {fmt(tl.busy):>10}  {fmt(result.makespan - tl.busy):>10}  "
                     f"{tl.peak_activations:>{len(head)}}{more}")
    lines.append("")
    if rows is None:
        lines.append(f"(the same-model comparison is skipped: it would simulate {work} forward actions, more than "
                     f"{COMPARE_BUDGET}; use fewer micro-batches)")
        return "\n".join(lines)
    lines.append(f"the same model under every schedule, {padded.real} micro-batches, costs per stage f={fmt(stage.f)} "
                 f"b={fmt(stage.b)} w={fmt(stage.w)} fb={fmt(stage.fused)}: 1F1B, ZB-H1 and DualPipe run a stage per "
                 f"action, DualPipeV a chunk of half a stage at half these costs, interleaved 1F1B chunks of 1/v"
                 + ("; p2p latency is not in the closed forms" if costs.p2p else "") + ":")
    lines.extend("  " + line for line in table(rows, mark=s.name))
    mine = next(r for r in rows if r.name == s.name)
    if padded.fake_count:
        lines.append("(padded runs: the closed forms assume full pipelines, no fake micro-batches)")
    elif mine.formula is not None:
        lines.append(f"{s.name}: simulated bubble - closed form = {fmt(mine.bubble - mine.formula)}")
    return "\n".join(lines)

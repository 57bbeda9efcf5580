"""``megatron-dualpipe simulate``: time a schedule with hypothetical costs, compare every schedule
on the same model, draw the timeline."""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import List

from ..apps.progress import Progress
from ..costs import stage_pairs
from ..costs.comm_cost import grad_comm
from ..costs.compare import compare, fmt, in_other_placement, orders_with, stage_fraction, table
from ..schedule import registry
from ..schedule.registry import ScheduleError
from ..schedule.simulate import DeadlockError, simulate
from .args import (CliError, Command, add_comm_args, add_cost_args, check_writable, comm_from_args, costs_from_args,
                   png_path)
from .build import MAX_FORWARDS, add_schedule_args, build, padding_note, per_direction


def configure(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    add_cost_args(p, "costs (hypothetical time units; dualpipev: per chunk, half a stage)")
    add_comm_args(p)
    g = p.add_argument_group("uneven stages (which stages each rank holds under 1F1B, DualPipe and DualPipeV, and "
                             "their summed cost)")
    g.add_argument("--stage-costs", metavar="C0,C1,...", help="each stage's cost per micro-batch: pp values (a "
                   "stage's V-stages then cost half each) or 2*pp (DualPipeV's V-stages); 3,4*14,5 repeats 4")
    g.add_argument("--layout", metavar="LAYOUT", help="Megatron's --pipeline-model-parallel-layout of pp or 2*pp "
                   "stages (E embedding, t layer, m MTP, L output layer and loss), priced by --layer-costs")
    g.add_argument("--layer-costs", metavar="E=0,t=1,m=1,L=0", default="",
                   help="cost of each layout letter (default t=1, m=1, E=0, L=0)")
    p.add_argument("--json", action="store_true",
                   help="print makespan, bubble, peak_activations, busy and the same-model comparison as JSON")
    p.add_argument("--png", metavar="FILE.png", type=png_path, help="draw the timeline to a PNG (needs matplotlib)")
    p.add_argument("--svg", metavar="FILE", help="draw the timeline to an SVG")


def stage_cost_views(args, pp: int):
    """(pp stage costs, 2pp V-stage costs) of ``--stage-costs`` or ``--layout``, or None."""
    if args.stage_costs is not None and args.layout is not None:
        raise CliError("--stage-costs and --layout both price the stages: give one")
    if args.layer_costs and args.layout is None:
        raise CliError("--layer-costs prices the letters of a --layout: give --layout too")
    if args.stage_costs is not None:  # their ValueErrors (LayoutError too) are one-line errors of main's
        return stage_pairs.views(stage_pairs.parse_costs(args.stage_costs), pp)
    if args.layout is not None:
        layer_costs = stage_pairs.parse_layer_costs(args.layer_costs) if args.layer_costs else {}
        return stage_pairs.layout_costs(args.layout, layer_costs, pp)
    return None


#: The most forward actions the same-model comparison simulates (past it: skipped with a note).
COMPARE_BUDGET = 3 * MAX_FORWARDS


def _draw(args, padded, result, prog) -> list:
    """Write the --svg / --png pictures of the simulated run; returns the files written."""
    s, drawn = padded.schedule, []
    fake = padded.is_fake if padded.fake_count else None
    if args.svg:
        from ..pictures.draw import to_svg

        prog.phase(f"drawing {args.svg}")
        svg = to_svg(s, result, fake=fake)
        try:
            with open(args.svg, "w", encoding="utf-8") as fh:
                fh.write(svg)
        except OSError as e:
            raise CliError(f"cannot write {args.svg}: {e.strerror or e}") from None
        drawn.append(args.svg)
    if args.png:
        try:
            from ..pictures.figure import to_png

            prog.phase(f"drawing {args.png}")
            to_png(s, result, args.png, fake=fake)
        except ImportError:
            raise CliError("--png needs matplotlib: pip install matplotlib") from None
        except OSError as e:
            raise CliError(f"cannot write {args.png}: {e.strerror or e}") from None
        drawn.append(args.png)
    return drawn


def run(args) -> int:
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
        work = sum(_forwards(registry.spec(n), s.pp, padded.real) for n in names)
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
        print(json.dumps(dict(result.to_json(), schedule=s.name, pp=s.pp, microbatches=s.microbatches,
                              real_microbatches=padded.real,
                              gradient_communication=None if grad is None else {
                                  "iteration": grad.iteration, "exposed_per_rank": grad.exposed,
                                  "bd_sum_per_rank": grad.bd_total, "dp_reduce_per_rank": grad.dp_total},
                              other_placement=None if other is None else {
                                  "placement": other[0], "iteration": None if other[1] is None else other[1].iteration,
                                  "problem": other[2]},
                              same_model=None if rows is None else [r.to_json() for r in rows],
                              stage_costs=None if views is None else {"stages": views[0], "v_stages": views[1]})))
        return 0
    pairs = [] if views is None else [""] + stage_pairs.report(*views, (registry.ONE_F_ONE_B, registry.DUALPIPE,
                                                                        registry.DUALPIPEV))
    print("\n".join([_report(padded, costs, result, rows, stage, work, grad, other)] + pairs))
    return 0


def _forwards(spec, pp: int, real: int) -> int:
    """Forward actions ``spec`` simulates for ``real`` micro-batches (0 where it cannot run)."""
    if spec.pp_problem(pp) or real < spec.min_real_microbatches(pp):
        return 0
    try:
        return spec.model_stages(pp) * spec.padded_microbatches(pp, real)
    except ScheduleError:
        return 0


def _report(padded, costs, result, rows, stage, work, grad=None, other=None) -> str:
    s, spec = padded.schedule, padded.schedule.spec
    share = spec.model_stages(s.pp) // s.pp  # chunks per stage's worth of model
    per = ("per chunk (half a stage)" if share == 2 else f"per chunk (1/{share} of a stage)") \
        if spec.costs_per_chunk else "per stage"
    unit = s.layout.dir_word + "s" if spec.costs_per_chunk else "micro-batches"
    lines: List[str] = [f"{s.name}: pp={s.pp} M={s.microbatches} ({per_direction(s)})"]
    if note := padding_note(padded):
        lines.append(note)
    lines.append(f"costs {per}: f={fmt(costs.f)} b={fmt(costs.b)} w={fmt(costs.w)} fb={fmt(costs.fused)} "
                 f"p2p={fmt(costs.p2p)}")
    lines.append(f"makespan {fmt(result.makespan)}")
    if grad is not None:
        lines.append(f"iteration {fmt(round(grad.iteration, 3))} = makespan + exposed gradient communication "
                     f"{fmt(round(grad.iteration - result.makespan, 3))} (largest over the ranks; ms)")
    if other is not None:  # what the other rank placement does to a schedule with bd pairs
        placement, row, problem = other
        how = ("--placement paired (the launcher's --pair-placement: bd pairs on one node)" if placement == "paired"
               else "--placement megatron (without --pair-placement)")
        lines.append(f"placement: {s.name} cannot have its bd pairs on one node here: {problem}" if row is None else
                     f"placement: with {how}: iteration {fmt(round(row.iteration, 3))} instead of "
                     f"{fmt(round(grad.iteration, 3))}")
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


COMMAND = Command("simulate", "simulate a schedule with hypothetical costs; compare every schedule on the same "
                  "model, draw the timeline", configure, run)

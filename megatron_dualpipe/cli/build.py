"""The schedule ``schedule`` and ``simulate`` build from --schedule, --pp and --microbatches: what the
executor runs (padded with fake micro-batches unless ``--no-pad``), bounded by :data:`MAX_FORWARDS`
so that every accepted command ends in seconds."""
from __future__ import annotations

import argparse
from typing import Optional

from ..apps.progress import Progress
from ..schedule.padding import Padded
from ..schedule.registry import NAMES, ScheduleError, build_schedule
from ..schedule.registry import spec as get
from .args import CliError

#: Largest schedule built, in forward actions (fakes included): a few seconds of simulation.
MAX_FORWARDS = 65536


def add_schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", required=True, metavar="NAME", help=f"one of {', '.join(NAMES)}")
    p.add_argument("--pp", required=True, type=int, metavar="P", help="pipeline-parallel size (ranks)")
    p.add_argument("--microbatches", "-m", required=True, type=int, metavar="M",
                   help="micro-batches per step (dualpipe: both directions together)")
    p.add_argument("--pad", dest="pad", action="store_true", default=True,
                   help="run a micro-batch count the order cannot take (DualPipe: odd, or below 2*pp) padded "
                        "with fake micro-batches, as training does (default)")
    p.add_argument("--no-pad", dest="pad", action="store_false", help="refuse such counts instead")


def build(args, progress: Optional[Progress] = None):
    """The (padded) schedule for ``args``, refusing sizes past :data:`MAX_FORWARDS` before building."""
    spec = get(args.schedule)
    pp, m = args.pp, args.microbatches
    if pp < 1:
        raise CliError(f"pipeline size --pp must be a positive integer, got {pp}")
    if m < 1:
        raise CliError(f"number of micro-batches --microbatches must be a positive integer, got {m}")
    if problem := spec.pp_problem(pp):
        raise ScheduleError(problem)
    if args.pad:
        least = spec.min_real_microbatches(pp)
        if m < least:
            raise CliError(f"{spec.name} needs at least {least} micro-batches with pp={pp} (with fewer, "
                           f"padding would fill most of the pipeline with fakes), got {m}: set --microbatches "
                           f"to {least} or more")
        run = spec.padded_microbatches(pp, m)
    else:
        if problem := spec.microbatch_problem(pp, m):
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


def per_direction(s) -> str:
    counts = s.microbatches_per_direction()
    if len(counts) == 1:
        return f"{counts[0]} micro-batches"
    return ", ".join(f"{s.layout.dir_word} {d}: {n}" for d, n in sorted(counts.items()))


def padding_note(padded) -> str:
    return (f"{padded.real} micro-batches run as {padded.schedule.microbatches}: {padded.fake_count} fake "
            f"(padding, as in training: no data, no compute; --no-pad refuses instead)") if padded.fake_count else ""

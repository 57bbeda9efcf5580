"""``megatron-dualpipe`` command line (also ``python -m megatron_dualpipe``).

Subcommands are registered in :data:`COMMANDS`; adding one is a ``configure(parser)`` function
that adds its arguments, a ``run(args) -> int`` function, and one :func:`register` call::

    def _configure_train(p):
        p.add_argument("--config", required=True)

    def _run_train(args):
        ...
        return 0

    register("train", "train a model with a DualPipe schedule", _configure_train, _run_train)

Every bad argument ends with one line on stderr, ``megatron-dualpipe: error: ...``, and exit
status 2: raise :class:`CliError` (or ``ScheduleError`` / ``ValueError``) from ``run``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from . import data_prep

PROG = "megatron-dualpipe"
EXIT_USAGE = 2


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors under the program's name (also for subcommand parsers)."""

    def error(self, message):  # noqa: D401 - argparse API
        raise CliError(message)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: name -> Command, in registration order (the order ``--help`` lists them).
COMMANDS: Dict[str, Command] = {}


def register(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    COMMANDS[name] = Command(name, help, configure, run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="DeepSeek's DualPipe pipeline schedules for Megatron-LM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
        if not args.command:
            raise CliError(f"choose a command: {', '.join(COMMANDS)} (see {PROG} --help)")
        return int(COMMANDS[args.command].run(args) or 0)
    except (CliError, ValueError) as e:  # ScheduleError is a ValueError
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE


def _exit_main() -> None:
    sys.exit(main())


# ---------------------------------------------------------------------------------------------
# Shared arguments and helpers
# ---------------------------------------------------------------------------------------------

def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    from .schedule.registry import NAMES

    p.add_argument("--schedule", required=True, metavar="NAME", help=f"one of {', '.join(NAMES)}")
    p.add_argument("--pp", required=True, type=int, metavar="P", help="pipeline-parallel size (ranks)")
    p.add_argument("--microbatches", "-m", required=True, type=int, metavar="M",
                   help="micro-batches per step (dualpipe: both directions together)")


def _build(args):
    from .schedule import build_schedule

    return build_schedule(args.schedule, args.pp, args.microbatches)


def _write(path: str, data, binary: bool = False) -> None:
    try:
        with open(path, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
            fh.write(data)
    except OSError as e:
        raise CliError(f"cannot write {path}: {e.strerror or e}") from None


def _check_writable(path: str) -> None:
    """Fail before the work if ``path`` cannot be created (without leaving a file behind)."""
    import os

    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"cannot write {path}: is a directory")
    if not os.path.isdir(d):
        raise CliError(f"cannot write {path}: directory {d} does not exist")
    if not os.access(d, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CliError(f"cannot write {path}: permission denied")


# ---------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------

def _configure_schedule(p: argparse.ArgumentParser) -> None:
    _add_schedule_args(p)
    p.add_argument("--json", action="store_true", help="print the per-rank action lists as JSON")


def _run_schedule(args) -> int:
    from .schedule import format_grid

    s = _build(args)
    if args.json:
        print(json.dumps(s.to_json()))
        return 0
    per_dir = s.microbatches_per_direction()
    print(f"{s.name}: pp={s.pp} M={s.microbatches} ({s.layout.kind} layout, micro-batches per direction: "
          + ", ".join(f"dir {d}: {n}" for d, n in sorted(per_dir.items())) + ")")
    print("F forward, B input-grad backward, BW full backward, W deferred weight grad; "
          "F0.3 = direction 0 micro-batch 3; '+' = F fused with the backward after it")
    print(format_grid(s.ranks))
    return 0


register("schedule", "print the per-rank action lists of a schedule", _configure_schedule, _run_schedule)


# ---------------------------------------------------------------------------------------------
# simulate
# ---------------------------------------------------------------------------------------------

def _configure_simulate(p: argparse.ArgumentParser) -> None:
    _add_schedule_args(p)
    g = p.add_argument_group("costs (hypothetical time units; dualpipev: per chunk)")
    g.add_argument("--f", type=float, default=1.0, help="forward (default 1)")
    g.add_argument("--b", type=float, default=2.0, help="full backward, input + weight grads (default 2)")
    g.add_argument("--w", type=float, default=1.0, help="weight-grad part of the backward (default 1)")
    g.add_argument("--fb", type=float, default=None, help="fused F&B unit (default f+b)")
    g.add_argument("--p2p", type=float, default=0.0, help="latency of a send between ranks (default 0)")
    p.add_argument("--json", action="store_true", help="print makespan, bubble, peak_activations, busy as JSON")
    p.add_argument("--png", metavar="FILE", help="draw the timeline to a PNG (needs matplotlib)")
    p.add_argument("--svg", metavar="FILE", help="draw the timeline to an SVG")


def _costs(args):
    from .schedule.simulate import Costs

    for name in ("f", "b", "w", "fb", "p2p"):
        v = getattr(args, name)
        if v is not None and not math.isfinite(v):
            raise CliError(f"cost --{name} must be a finite number, got {v}")
    return Costs(f=args.f, b=args.b, w=args.w, fb=args.fb, p2p=args.p2p)


def _run_simulate(args) -> int:
    from .schedule.simulate import DeadlockError, simulate

    costs = _costs(args)
    s = _build(args)
    for path in (args.png, args.svg):
        if path:
            _check_writable(path)
    try:
        result = simulate(s.layout, s.ranks, costs)
    except DeadlockError as e:  # cannot happen for built schedules; keep the promise of one line
        raise CliError(" ".join(line.strip() for line in str(e).splitlines()[:2])) from None
    if args.svg:
        from .draw import to_svg

        _write(args.svg, to_svg(s, result))
    if args.png:
        from .draw import to_png

        try:
            to_png(s, result, args.png)
        except ImportError:
            raise CliError("--png needs matplotlib: pip install matplotlib") from None
        except OSError as e:
            raise CliError(f"cannot write {args.png}: {e.strerror or e}") from None
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(_report(s, costs, result))
    return 0


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    return f"{x:.3f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def _report(s, costs, result) -> str:
    from .schedule.registry import SPECS, distinct_orders

    lines: List[str] = []
    lines.append(f"{s.name}: pp={s.pp} M={s.microbatches}  costs f={_fmt(costs.f)} b={_fmt(costs.b)} "
                 f"w={_fmt(costs.w)} fb={_fmt(costs.fused)} p2p={_fmt(costs.p2p)}")
    lines.append(f"makespan {_fmt(result.makespan)}")
    lines.append("")
    lines.append(f"{'rank':>4}  {'busy':>10}  {'bubble':>10}  {'peak activations':>16}")
    for r, tl in enumerate(result.ranks):
        lines.append(f"{r:>4}  {_fmt(tl.busy):>10}  {_fmt(result.makespan - tl.busy):>10}  "
                     f"{tl.peak_activations:>16}")
    sim = max(result.bubble)
    lines.append("")
    lines.append("closed-form bubbles for these costs (simulated max bubble "
                 f"{_fmt(sim)}{', p2p latency not in the formulas' if costs.p2p else ''}):")
    for name in distinct_orders():
        spec = SPECS[name]
        text = spec.bubble_formula
        val = spec.formula_bubble(s.pp, costs)
        mark = ""
        if name == s.name and val is not None:
            mark = f"   <- this schedule; simulated - formula = {_fmt(sim - val)}"
        lines.append(f"  {name:<10} {text:<38} = {_fmt(val)}{mark}")
    return "\n".join(lines)


def _configure_patch(p):
    p.add_argument("path", help="root of a Megatron-LM checkout at tag core_v0.16.1")
    p.add_argument("--check", action="store_true", help="say what would change, change nothing")
    p.add_argument("--revert", action="store_true", help="remove the hook")


def _run_patch(args) -> int:
    from .megatron_lm.patching import PatchError, apply
    try:
        print(apply(args.path, revert=args.revert, check=args.check))
    except PatchError as e:
        raise CliError(str(e)) from None
    return 0


register("patch", "add the 3-line megatron-dualpipe hook to Megatron-LM's pretrain_gpt.py (or --revert it)",
         _configure_patch, _run_patch)


register("simulate", "simulate a schedule with hypothetical costs; print bubbles, draw the timeline",
         _configure_simulate, _run_simulate)
register("prepare-data", data_prep.HELP, data_prep.configure, data_prep.run)

from . import bench as _bench  # noqa: E402 - argparse only; the benchmark imports torch when run
register("bench", _bench.HELP, _bench.configure, _bench.run)
from . import timeline as _timeline  # noqa: E402 - standard library until run
register("trace", _timeline.HELP, _timeline.configure, _timeline.run)


from .cpu import command as _cpu_mode  # noqa: E402  (standard library only until it runs)

register("cpu-mode", "list every CPU-mode redirection and whether it is active (--enable: try it here)",
         _cpu_mode.configure, _cpu_mode.run)


if __name__ == "__main__":  # pragma: no cover
    _exit_main()

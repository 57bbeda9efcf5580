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
status 2: raise :class:`CliError` (or ``ScheduleError`` / ``ValueError``) from ``run``. Ctrl-C
(130), a closed pipe (141, silent), an ``OSError`` such as a permission error (1) and an
``OverflowError`` (2) end in one line too; ``tests/cli/test_no_traceback.py`` runs every registered
command with bad input.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

from ..apps import data_prep

from .args import CliError  # noqa: F401 - raised by commands; re-exported

PROG = "megatron-dualpipe"
EXIT_USAGE = 2


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
    from .. import __version__

    parser = _Parser(prog=PROG, description="DeepSeek's DualPipe pipeline schedules for Megatron-LM.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
    return parser


from ..interrupts import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED  # noqa: E402,F401 - 130 and 141, re-exported
#: Exit status for a failure that is not a usage error (a file that cannot be written, ...).
EXIT_FAILURE = 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command. A user's mistake or an interruption ends in one line on stderr and a
    non-zero status, never a traceback; only a bug in this package shows one."""
    from .. import interrupts

    interrupts.install()  # SIGTERM and SIGHUP end a command as Ctrl-C does
    try:
        parser = build_parser()
        args = parser.parse_args(None if argv is None else list(argv))
        if not args.command:
            raise CliError(f"choose a command: {', '.join(COMMANDS)} (see {PROG} --help)")
        status = int(COMMANDS[args.command].run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handlers below
        return status
    except (CliError, ValueError) as e:  # ScheduleError is a ValueError
        return _fail(str(e) or type(e).__name__, EXIT_USAGE)
    except KeyboardInterrupt:
        return interrupts.interrupted(PROG)  # one line; the command stopped what it started
    except BrokenPipeError:
        return interrupts.reader_gone()
    except OverflowError as e:
        return _fail(f"a number is too large ({e}): use smaller values or units", EXIT_USAGE)
    except MemoryError:
        return _fail("out of memory: use a smaller pipeline or fewer micro-batches", EXIT_FAILURE)
    except OSError as e:  # e.g. PermissionError, disk full
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}", EXIT_FAILURE)


def _fail(message: str, status: int) -> int:
    try:
        print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    except OSError:
        pass
    return status


def _exit_main() -> None:
    sys.exit(main())


# ---------------------------------------------------------------------------------------------
# Commands (those in their own modules: one line each)
# ---------------------------------------------------------------------------------------------
from . import advise as _advise  # noqa: E402
from . import schedule as _cli_schedule

register("schedule", "print the per-rank action lists of a schedule", _cli_schedule.configure_schedule,
         _cli_schedule.run_schedule)
register("simulate", "simulate a schedule with hypothetical costs; compare every schedule on the same model, "
         "draw the timeline", _cli_schedule.configure_simulate, _cli_schedule.run_simulate)
register("advise", _advise.HELP, _advise.configure, _advise.run)


def _configure_patch(p):
    p.add_argument("path", help="root of a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.0")
    p.add_argument("--check", action="store_true", help="say what would change, change nothing")
    p.add_argument("--revert", action="store_true", help="remove the hook")


def _run_patch(args) -> int:
    from ..megatron_lm.patching import PatchError, apply
    try:
        print(apply(args.path, revert=args.revert, check=args.check))
    except PatchError as e:
        raise CliError(str(e)) from None
    return 0


register("patch", "add the 3-line megatron-dualpipe hook to Megatron-LM's pretrain_gpt.py (or --revert it)",
         _configure_patch, _run_patch)


register("prepare-data", data_prep.HELP, data_prep.configure, data_prep.run)

from . import bench as _bench  # noqa: E402 - argparse only; the benchmark imports torch when run
register("bench", _bench.HELP, _bench.configure, _bench.run)
from . import trace as _timeline  # noqa: E402 - standard library until run
register("trace", _timeline.HELP, _timeline.configure, _timeline.run)


from .. import selftest as _selftest  # noqa: E402 - argparse only until it runs
register("selftest", _selftest.HELP, _selftest.configure, _selftest.run)

from . import cpu_mode as _cpu_mode  # noqa: E402  (standard library only until it runs)

register("cpu-mode", "list every CPU-mode redirection and whether it is active (--enable: try it here)",
         _cpu_mode.configure, _cpu_mode.run)
from . import hooks as _hooks  # noqa: E402  (standard library only until it runs)

register("hooks", _hooks.HELP, _hooks.configure, _hooks.run)


if __name__ == "__main__":  # pragma: no cover
    _exit_main()

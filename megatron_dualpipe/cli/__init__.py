"""``megatron-dualpipe`` command line (also ``python -m megatron_dualpipe``): one module per command, each exporting
its ``args.Command`` as ``COMMAND``, listed once in :data:`COMMANDS`.

A user's mistake ends in one line, ``megatron-dualpipe: error: ...``, never a traceback: raise :class:`CliError` (or
``ValueError``) from ``run`` (``tests/cli/test_no_traceback.py`` tries them all)."""
from __future__ import annotations

import argparse
import sys
from typing import Dict, Optional, Sequence

from ..launch import interrupts
from . import advise, bench, cpu_mode, hooks, patch, prepare_data, schedule, selftest, simulate, trace
from .args import CliError, Command

PROG = "megatron-dualpipe"
EXIT_USAGE = 2
#: Exit status for a failure that is not a usage error (a file that cannot be written, ...).
EXIT_FAILURE = 1

#: name -> Command, in the order ``--help`` lists them.
COMMANDS: Dict[str, Command] = {m.COMMAND.name: m.COMMAND for m in (
    schedule, simulate, advise, patch, prepare_data, bench, trace, selftest, cpu_mode, hooks)}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors under the program's name (also for subcommand parsers)."""

    def error(self, message):  # noqa: D401 - argparse API
        raise CliError(message)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog=PROG, description="DeepSeek's DualPipe pipeline schedules for Megatron-LM.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS.values():
        cmd.configure(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; only a bug in this package ends in a traceback."""
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

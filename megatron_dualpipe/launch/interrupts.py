"""Ctrl-C, SIGTERM and a closed pipe end a command in one line, with every process it started
stopped and our output then silenced: :func:`guarded` for a main function (130, or a silent 141 as
``cat`` does); ``python -m megatron_dualpipe.launch.interrupts --prog NAME -- CMD`` for shell scripts.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Callable, Optional, Sequence

from . import processes

#: Signals that interrupt besides SIGINT (which raises KeyboardInterrupt by itself).
_SIGNALS = ("SIGTERM", "SIGHUP")


def _raise_interrupt(signum, frame):  # noqa: ARG001 - signal handler signature
    raise KeyboardInterrupt


def install() -> None:
    """Make SIGTERM and SIGHUP raise :class:`KeyboardInterrupt` in the main thread, as Ctrl-C does
    (SIGINT keeps its handler: a background job of a non-interactive shell keeps it ignored)."""
    processes.handle(_SIGNALS, _raise_interrupt)


def _end(last_line: str = "") -> None:
    """Stop the processes we started, print ``last_line``, then point stdout and stderr at /dev/null:
    nothing more gets out (not a background thread, not the interpreter's final flush)."""
    processes.handle(processes.INTERRUPTING, signal.SIG_IGN)  # a second Ctrl-C must not start a traceback
    processes.stop_descendants()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        if last_line:
            print(last_line, file=sys.stderr, flush=True)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(devnull, stream.fileno())


def interrupted(prog: str) -> int:
    """Stop the processes we started, print ``PROG: interrupted``, silence our output, return 130."""
    _end(f"{prog}: interrupted")
    return 130  # 128 + SIGINT, as a shell reports it


def reader_gone() -> int:
    """Our stdout's reader went away: stop the processes we started, silence our output, return 141."""
    _end()
    return 141  # 128 + SIGPIPE


def guarded(main: Callable[[], Optional[int]], prog: str) -> int:
    """``main()``'s exit status; an interruption or a closed stdout ends in one line (or none)."""
    install()
    try:
        status = main()
        sys.stdout.flush()  # a closed pipe shows up here
        return int(status or 0)
    except KeyboardInterrupt:
        return interrupted(prog)
    except BrokenPipeError:
        return reader_gone()


def _main(argv: Sequence[str]) -> int:
    usage = "usage: python -m megatron_dualpipe.launch.interrupts [--prog NAME] -- CMD [ARGS...]"
    argv, prog = list(argv), "interrupted command"
    if argv[:1] == ["--prog"] and len(argv) > 1:
        prog, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    # A script may start this in the background, where the shell leaves SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status = guarded(lambda: processes.run(argv), prog)
        return 128 - status if status < 0 else status  # killed by a signal: as a shell reports it
    except FileNotFoundError:
        print(f"{prog}: error: {argv[0]}: command not found", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

"""Bound every phase of every selftest stage on every rank: a rank past the limit prints the phase
and each thread's stack and exits with :data:`STUCK_EXIT`. Timeouts alone do not do it: one rank
stuck in a collective (a barrier, a bd sum, the gathering) would hold the others silently for the
process group's timeout. The parent (spawn or torchrun) then stops the others.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import threading
from typing import Optional

#: Exit status of a rank the watchdog stopped.
STUCK_EXIT = 3
#: The stage limit in units of ``--deadline`` (one point-to-point wait): a stage runs a few dozen
#: iterations of tiny models; on a loaded CPU machine the slowest (speed) takes ~15 deadlines of 1 s.
LIMIT_PER_DEADLINE = 30.0
#: The set-up before the first stage (importing megatron-core, building its parallel groups) has
#: nothing to do with ``--deadline``: on a loaded 2-core machine its imports alone took over 15 s.
SETUP_LIMIT_S = 300.0


class StageWatchdog:
    """One per rank. :meth:`enter` starts (or restarts) the clock for a phase, :meth:`stop` ends it."""

    def __init__(self, rank: int, limit_s: float, deadline_s: float, stream=None):
        self.rank, self.limit_s, self.deadline_s = rank, limit_s, deadline_s
        self.stream = stream if stream is not None else sys.stderr
        self._timer: Optional[threading.Timer] = None

    def enter(self, phase: str, limit_s: Optional[float] = None) -> None:
        """Start the clock for ``phase``: the stage limit, or ``limit_s`` (the set-up's)."""
        self.stop()
        self._timer = threading.Timer(self.limit_s if limit_s is None else limit_s, self._fire,
                                      args=(phase, limit_s))
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self, phase: str, limit_s: Optional[float]) -> None:
        self.report(phase, limit_s)
        os._exit(STUCK_EXIT)

    def report(self, phase: str, limit_s: Optional[float] = None) -> None:
        """Say which phase is stuck and where every thread is, one line per write (atomic on a pipe):
        the ranks of a stuck job fire together into one stderr, and ``faulthandler`` writes a line in
        pieces, so the stacks go to a scratch file first and leave line by line, marked with the rank."""
        why = (f"the stage limit, {LIMIT_PER_DEADLINE:g} x --deadline {self.deadline_s:g}; raise --deadline on a slow "
               f"or busy machine" if limit_s is None else "the set-up limit")
        lines = [f"megatron-dualpipe selftest: rank {self.rank} still {phase} after "
                 f"{self.limit_s if limit_s is None else limit_s:g} s ({why}); stopping this rank. Where its threads are:"]
        with tempfile.TemporaryFile(mode="w+") as scratch:
            faulthandler.dump_traceback(file=scratch, all_threads=True)
            scratch.seek(0)
            # faulthandler's "Current thread" is this timer's: name the thread that is stuck
            lines.append(f"[rank {self.rank}] main thread 0x{threading.main_thread().ident:016x}")
            lines += [f"[rank {self.rank}] {line.rstrip()}" for line in scratch if line.strip()]
        for line in lines:
            self._write_line(line + "\n")

    def _write_line(self, line: str) -> None:
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):  # an in-memory stream: nobody to interleave with
            self.stream.write(line)
            return
        self.stream.flush()
        os.write(fd, line.encode(errors="replace"))

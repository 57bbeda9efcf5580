"""Progress on stderr for command-line work that may take more than a second: nothing within
:data:`QUIET_SECONDS`; then a background thread reports the current phase, rewriting one line on a
terminal, one line every few seconds otherwise. :meth:`~Progress.say` prints a finished step at once.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional, TextIO

#: Work shorter than this prints nothing.
QUIET_SECONDS = 1.0


class Progress:
    def __init__(self, what: str, stream: Optional[TextIO] = None, interval: Optional[float] = None):
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (1.0 if self.tty else 5.0)
        self._phase, self._fraction, self._printed = "", None, False
        self._start, self._stop, self._lock = time.monotonic(), threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._tick, name="progress", daemon=True)

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._printed and self.tty:
            self._write("\r\033[K")

    def phase(self, name: str) -> None:
        self._phase, self._fraction = name, None

    def update(self, done: int, total: int) -> None:
        self._fraction = done / total if total else None

    def say(self, message: str) -> None:
        """One line now, ``what: message`` (clearing the phase line on a terminal)."""
        self._phase, self._fraction = "", None
        with self._lock:
            self._write(("\r\033[K" if self._printed and self.tty else "") + f"{self.what}: {message}\n")

    def line(self) -> str:
        frac = "" if self._fraction is None else f" {100 * self._fraction:.0f}%"
        return f"{self.what}: {self._phase}{frac} ({time.monotonic() - self._start:.0f} s)"

    def _tick(self) -> None:
        if self._stop.wait(QUIET_SECONDS):
            return
        while True:
            with self._lock:
                if self._phase:  # between a said step and the next phase: nothing to report
                    self._write(("\r\033[K" + self.line()) if self.tty else self.line() + "\n")
                    self._printed = True
            if self._stop.wait(self.interval):
                return

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed or gone: progress is optional
            pass

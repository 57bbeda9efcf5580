"""Preloaded first by :func:`.spawn.run`'s forkserver: it and its ranks leave the terminal's process
group, so a Ctrl-C reaches only the parent, which stops them all (not one traceback per rank)."""
import contextlib
import os

with contextlib.suppress(OSError):  # already a session leader
    os.setsid()

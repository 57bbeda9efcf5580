"""Imported first by the benchmark's forkserver (its preload list, :func:`..bench.launch.spawn`).

The forkserver and the workers it forks leave the terminal's process group here, so a Ctrl-C
reaches only the parent, which stops them all (:mod:`.processes`); otherwise
each of them would print its own ``KeyboardInterrupt`` traceback while importing torch.
"""
import os

try:
    os.setsid()
except OSError:  # already a session leader
    pass

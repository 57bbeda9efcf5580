"""Imported first by the forkserver that :func:`.spawn.run` forks the ranks from (its preload list).

The forkserver and the ranks it forks leave the terminal's process group here, so a Ctrl-C
reaches only the parent, which stops them all (:func:`.spawn.run`); otherwise each of them would
print its own ``KeyboardInterrupt`` traceback while importing torch.
"""
import os

try:
    os.setsid()
except OSError:  # already a session leader
    pass

"""Imported by the selftest's forkserver only (the last of :data:`.worker.PRELOAD`): when the
selftest's process ends, the forkserver leaves with ``os._exit``, without the teardown of the
megatron-core modules it preloaded (1-2 s here), during which it still held the selftest's stdout
and stderr open: whoever reads the selftest's output to its end waited for it. Nothing else imports
this module; the ranks the forkserver forks leave with ``os._exit`` anyway (multiprocessing's
forkserver children), so the handler never runs in them.
"""
import atexit
import os
import sys


def _leave() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say
            pass
    os._exit(0)


atexit.register(_leave)

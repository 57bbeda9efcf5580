"""``config.param_sync_func`` on the executor: each chunk's parameter all-gathers started before its first
forward (``--overlap-param-gather`` with the default ``--align-param-gather``).

Without it each bucket's pre-hook would start its own all-gather and wait at once. As Megatron's interleaved
schedule does, the program's ``gather C`` op starts a chunk's gathers before the first action, in the order of
the chunks' first forwards (one NCCL communicator runs them in issue order), and DDP's pre-hook waits after
``gathered C``. Only chunks with a real forward are gathered; evaluation gathers none.
"""
from __future__ import annotations

import logging
from typing import Sequence

log = logging.getLogger("megatron_dualpipe")

__all__ = ["ANNOUNCED", "start"]

#: What a process logs once, the first time it starts the gathers (tests look for it).
ANNOUNCED = "parameter all-gathers started before the first action"
_announced = False


def start(config, model: Sequence, c: int, chunks: Sequence[int], describe: str = "") -> None:
    """Call ``config.param_sync_func`` for chunk ``c`` (a ``gather`` op); ``chunks``, every chunk the program
    gathers, are named in the line logged once per process."""
    funcs = getattr(config, "param_sync_func", None)
    if funcs is None:
        raise RuntimeError(f"megatron-dualpipe: the program gathers chunk {c}'s parameters, but "
                           f"config.param_sync_func is not set (a bug)")
    (funcs[c] if isinstance(funcs, (list, tuple)) else funcs)(model[c].parameters())  # a bare one: one chunk
    global _announced
    if not _announced:
        _announced = True
        log.info("megatron-dualpipe: %s%s of model chunk(s) %s (config.param_sync_func, --overlap-param-gather); "
                 "each waits at its chunk's first forward", describe, ANNOUNCED, ", ".join(map(str, chunks)))

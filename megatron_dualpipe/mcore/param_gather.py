"""``config.param_sync_func`` on the executor: each chunk's parameter all-gathers started before
its first forward (``--overlap-param-gather`` with the default ``--align-param-gather``).

With the distributed optimizer, a chunk's parameters are gathered from their data-parallel
shards before its first forward of the iteration. Megatron-LM hands every chunk's
``start_param_sync`` to the schedule as ``config.param_sync_func``; DDP's forward pre-hooks then
only wait for the gathers. Without the call, each bucket's pre-hook starts its own all-gather
and waits for it at once (aligned gathers skip the prefetch of the next bucket): correct, and
nothing hidden. Megatron's interleaved schedule starts the first two chunks' gathers before its
first forward (``config.param_sync_func[i](model[i].parameters())``, chunks 0 and 1); the
executor does the same for its two chunks: before the first action, in the order of their first
forwards (chunk 0 first there; DualPipe's ranks pp/2.. run chunk 1 first, and one NCCL
communicator runs the gathers in issue order). The point and the order are ops of the rank's
program (``gather C`` first, ``gathered C`` before the ``run`` of the chunk's first real forward:
``schedule.lowering``), the same on every member of a data-parallel group (they run the same
program), so the collectives meet in the same order everywhere; ``mcore.program_ops`` calls
:func:`start` for each ``gather``, and the wait is DDP's pre-hook in the ``run`` after ``gathered``.

Only chunks with a real forward in the iteration are started
(``schedule.lowering.collectives.chunks_with_real_forward``). Evaluation starts none: Megatron's schedules clear
``param_sync_func`` for ``forward_only``.
"""
from __future__ import annotations

import logging
from typing import Callable, List, Sequence

log = logging.getLogger("megatron_dualpipe")

__all__ = ["ANNOUNCED", "start"]

#: What a process logs once, the first time it starts the gathers (tests look for it).
ANNOUNCED = "parameter all-gathers started before the first action"
_announced = False


def _per_chunk(funcs, n: int) -> List[Callable]:
    """``config.param_sync_func`` as one function per chunk (Megatron-LM passes a bare function
    when there is one chunk)."""
    return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs] * n


def start(config, model: Sequence, c: int, chunks: Sequence[int], describe: str = "") -> None:
    """Call ``config.param_sync_func`` for chunk ``c`` (a ``gather`` op); ``chunks``: every chunk
    the program gathers, named in the log line said once per process."""
    funcs = getattr(config, "param_sync_func", None)
    if funcs is None:
        raise RuntimeError(f"megatron-dualpipe: the program gathers chunk {c}'s parameters, but "
                           f"config.param_sync_func is not set (a bug)")
    _per_chunk(funcs, len(model))[c](model[c].parameters())
    global _announced
    if not _announced:
        _announced = True
        log.info("megatron-dualpipe: %s%s of model chunk(s) %s (config.param_sync_func, --overlap-param-gather); "
                 "each waits at its chunk's first forward", describe, ANNOUNCED, ", ".join(map(str, chunks)))

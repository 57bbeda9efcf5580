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
communicator runs the gathers in issue order). The point and the order are fixed in the program,
the same on every member of a data-parallel group (they run the same program), so the
collectives meet in the same order everywhere; each chunk's wait is the pre-hook of its first
real forward (``schedule.iteration_plan`` models both).

Only chunks with a real forward in the iteration are started
(``schedule.iteration_plan.chunks_with_real_forward``). Evaluation starts none: Megatron's schedules clear
``param_sync_func`` for ``forward_only``.
"""
from __future__ import annotations

import logging
from typing import Callable, List, Sequence

from ..schedule.iteration_plan import chunks_with_real_forward

log = logging.getLogger("megatron_dualpipe")

__all__ = ["ANNOUNCED", "start_param_gathers"]

#: What a process logs once, the first time it starts the gathers (tests look for it).
ANNOUNCED = "parameter all-gathers started before the first action"
_announced = False


def _per_chunk(funcs, n: int) -> List[Callable]:
    """``config.param_sync_func`` as one function per chunk (Megatron-LM passes a bare function
    when there is one chunk)."""
    return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs] * n


def start_param_gathers(config, model: Sequence, actions: Sequence, padding: Sequence[bool], *, forward_only: bool,
                        describe: str = "") -> List[int]:
    """Call ``config.param_sync_func`` for every chunk with a real forward, in the order of their
    first forwards (see the module docstring); return the chunks started."""
    funcs = getattr(config, "param_sync_func", None)
    if funcs is None or forward_only:
        return []
    funcs = _per_chunk(funcs, len(model))
    chunks = chunks_with_real_forward([a for a, fake in zip(actions, padding) if not fake], lambda a: False)
    for c in chunks:
        funcs[c](model[c].parameters())
    global _announced
    if chunks and not _announced:
        _announced = True
        log.info("megatron-dualpipe: %s%s of model chunk(s) %s (config.param_sync_func, --overlap-param-gather); "
                 "each waits at its chunk's first forward", describe, ANNOUNCED, ", ".join(map(str, chunks)))
    return chunks

"""Make megatron-core's pipeline-position questions answer for the direction being computed.

Megatron code such as ``pretrain_gpt.get_batch`` and ``get_batch_on_this_tp_rank`` asks
``parallel_state.is_pipeline_first_stage()`` / ``is_pipeline_last_stage()`` (no arguments)
to decide whether to read tokens and labels. With DualPipe a rank holds two stages: on
pipeline rank i, direction 0 is stage i and direction 1 is stage pp-1-i (DualPipeV: stage
2*pp-1-i). Inside :func:`direction_of`, these ``parallel_state`` functions answer for the
stage of that direction:

* ``is_pipeline_first_stage`` / ``is_pipeline_last_stage``
* ``get_pipeline_model_parallel_next_rank`` / ``get_pipeline_model_parallel_prev_rank``
  (swapped when the direction runs from rank pp-1 towards rank 0)
* ``get_pipeline_model_parallel_rank`` (pp-1-i for DualPipe's direction 1; DualPipeV's
  second chunk has no pipeline rank of its own and keeps i)

They are replaced as attributes of ``megatron.core.parallel_state`` (through
``megatron_dualpipe.hooks.scoped``: the entries are in the hooks manifest) and restored on exit, so
callers that look them up through the module (``mpu.is_pipeline_first_stage()``, as Megatron-LM
does) see the override. Code that imported one of them by name *before* the override
(``from megatron.core.parallel_state import is_pipeline_last_stage``) keeps the original:
megatron-core 0.16.1's model code takes the pipeline position from ``pg_collection`` and
``pre_process``/``post_process`` instead, and ``megatron.training.utils`` reads them through
``mpu``. ``megatron.core.pipeline_parallel.schedules`` is not affected: the executor passes
``is_last_stage`` explicitly.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from ..schedule.layout import V_SHAPE, Layout

from .. import hooks

_NAMES = (
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "get_pipeline_model_parallel_rank",
)
_PATCHES = tuple(hooks.entry("scoped", name) for name in _NAMES)


def _answer(value):
    return lambda *a, **k: value


@contextlib.contextmanager
def direction_of(layout: Layout, rank: int, d: int, global_ranks) -> Iterator[None]:
    """Within the block, parallel_state answers for the stage of direction ``d`` on ``rank``.

    Direction 0 of every layout is the physical pipeline, so nothing changes for it, but for
    DualPipeV's rank pp-1: its direction-0 stage (pp-1) is not the model's last, so there
    ``is_pipeline_last_stage()`` answers False and the rank reads no labels (it never uses them;
    the loss is computed on rank 0).
    """
    if d == 0:
        if layout.kind == V_SHAPE and rank == layout.pp - 1:
            with hooks.scoped(_PATCHES[1].to(_answer(False))):
                yield
        else:
            yield
        return
    stage = layout.stage_on(rank, d)
    pp = layout.pp
    answers = (layout.is_first(d, stage), layout.is_last(d, stage), global_ranks[(rank - 1) % pp],
               global_ranks[(rank + 1) % pp], layout.partner(rank) if layout.mirrored else rank)
    with hooks.scoped(*(patch.to(_answer(value)) for patch, value in zip(_PATCHES, answers))):
        yield

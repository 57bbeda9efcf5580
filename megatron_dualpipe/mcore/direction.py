"""Make megatron-core's pipeline-position questions answer for the direction being computed.

A rank holds two stages, and Megatron code such as ``pretrain_gpt.get_batch`` asks ``is_pipeline_first_stage()``
/ ``is_pipeline_last_stage()`` whether to read tokens and labels. Inside :func:`direction_of` those, the next /
previous rank and the pipeline rank are swapped on ``parallel_state`` (``hooks.scoped``) for the direction's
stage: callers going through the module (``mpu.``, as Megatron-LM's) see it; megatron-core's model code reads
``pg_collection`` and ``pre_process``/``post_process`` instead.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from ..schedule.layout import V_SHAPE, Layout

from .. import hooks

_NAMES = ("is_pipeline_first_stage", "is_pipeline_last_stage", "get_pipeline_model_parallel_next_rank",
          "get_pipeline_model_parallel_prev_rank", "get_pipeline_model_parallel_rank")
_PATCHES = tuple(hooks.entry("scoped", name) for name in _NAMES)


def _answer(value):
    return lambda *a, **k: value


@contextlib.contextmanager
def direction_of(layout: Layout, rank: int, d: int, global_ranks) -> Iterator[None]:
    """Within the block, parallel_state answers for the stage of direction ``d`` on ``rank``. Direction 0 is
    the physical pipeline, but DualPipeV's stage pp-1 is not the model's last (the loss is on rank 0)."""
    if d == 0:
        v_last = layout.kind == V_SHAPE and rank == layout.pp - 1
        with hooks.scoped(_PATCHES[1].to(_answer(False))) if v_last else contextlib.nullcontext():
            yield
        return
    stage = layout.stage_on(rank, d)
    pp = layout.pp
    answers = (layout.is_first(d, stage), layout.is_last(d, stage), global_ranks[(rank - 1) % pp],
               global_ranks[(rank + 1) % pp], layout.partner(rank) if layout.mirrored else rank)
    with hooks.scoped(*(patch.to(_answer(value)) for patch, value in zip(_PATCHES, answers))):
        yield

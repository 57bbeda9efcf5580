"""Test-only fault injection, so that the tests can show the selftest catching a broken executor.

``swap-microbatch`` makes the DualPipe runs of the equality stage read micro-batches 0 and 1 in
swapped order on the last pipeline rank (a broken executor delivering the wrong micro-batch to a
stage). ``tests/apps/test_selftest.py`` checks that the selftest then FAILs with the loss
difference; nothing else sets it. ``wrong-gradient`` makes DualPipeV's gradient of one router weight
on pipeline rank 0 of the ``deepseek-v3`` stage 0.1% too large (a broken executor accumulating a
gradient wrongly), which that stage must catch. ``stall:STAGE`` makes rank 1 never end STAGE (a rank stuck where
no timeout of its own applies), which the watchdog must stop.
"""
from __future__ import annotations

import os
from typing import List

FAULT_ENV = "MEGATRON_DUALPIPE_SELFTEST_FAULT"


def faulty(micro_batches: List[dict]) -> List[dict]:
    """The fault ``swap-microbatch``: micro-batches 0 and 1 swapped on the last pipeline rank."""
    from megatron.core import parallel_state as ps

    if os.environ.get(FAULT_ENV) == "swap-microbatch" and ps.is_pipeline_last_stage() and len(micro_batches) > 1:
        micro_batches = [micro_batches[1], micro_batches[0], *micro_batches[2:]]
    return micro_batches


WRONG_GRADIENT_SCALE = 1.001


def wrong_gradient(schedule: str, chunks) -> None:
    """The fault ``wrong-gradient``: under DualPipeV, on pipeline rank 0, the first router weight's
    gradient (any parameter's if there is none) times :data:`WRONG_GRADIENT_SCALE`, in place."""
    from megatron.core import parallel_state as ps

    from ..schedule.registry import DUALPIPEV

    if os.environ.get(FAULT_ENV) != "wrong-gradient" or schedule != DUALPIPEV:
        return
    if ps.get_pipeline_model_parallel_rank():
        return
    grads = [(n, p.grad) for c in chunks for n, p in c.named_parameters() if p.grad is not None]
    _, grad = next(((n, g) for n, g in grads if "router" in n), grads[0])
    grad.mul_(WRONG_GRADIENT_SCALE)


def stalls(stage_name: str, rank: int) -> bool:
    """The fault ``stall:STAGE``: whether this rank must never end this stage."""
    return os.environ.get(FAULT_ENV) == f"stall:{stage_name}" and rank == 1

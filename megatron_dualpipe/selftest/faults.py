"""Test-only fault injection (``MEGATRON_DUALPIPE_SELFTEST_FAULT``) to show the selftest catching a broken
executor: ``swap-microbatch`` (equality), ``wrong-gradient`` (deepseek-v3), ``stall:STAGE`` (the watchdog).
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

    if os.environ.get(FAULT_ENV) != "wrong-gradient" or schedule != DUALPIPEV or ps.get_pipeline_model_parallel_rank():
        return
    grads = [(n, p.grad) for c in chunks for n, p in c.named_parameters() if p.grad is not None]
    _, grad = next(((n, g) for n, g in grads if "router" in n), grads[0])
    grad.mul_(WRONG_GRADIENT_SCALE)


def stalls(stage_name: str, rank: int) -> bool:
    """The fault ``stall:STAGE``: whether this rank must never end this stage."""
    return os.environ.get(FAULT_ENV) == f"stall:{stage_name}" and rank == 1

"""Stage ``overlap``: how much of the MoE all-to-all the fused F&B units hide.

DualPipe's fused units run one direction's forward with the other's backward so that one's
dispatch/combine all-to-all runs on the communication stream while the other computes. What is
hidden can only be seen on a GPU, with CUDA events on both streams. On the CPU the combined step
runs its sub-steps in order on one stream: nothing can overlap, so nothing is measured (the
equality stage still runs the combined step there, for its numbers).

This version measures nothing on GPUs either: the stage says so instead of reporting a number it
did not measure. (The events would go around megatron-core's ``moe_dispatch`` / ``moe_combine``
schedule nodes on the communication stream and the other sub-steps on the compute stream.)
"""
from __future__ import annotations

from typing import List

from .result import SKIP, StageResult

NAME = "overlap"


def run(ctx) -> None:
    return None


def judge(ctx, payloads: List[object]) -> StageResult:
    if ctx.cfg.ep <= 1:
        reason = "no --ep: the fused F&B units hide MoE all-to-all, which needs expert parallelism (--ep 2 or more)"
    elif not ctx.cfg.gpu:
        reason = ("not measurable on the CPU: the combined step runs dispatch, combine and compute in order on one "
                  "stream (the equality stage checked the fused units' numbers)")
    else:
        reason = ("not measured by this version: the CUDA-event measurement on the communication stream is not "
                  "written yet (the equality stage checked the fused units' numbers on this GPU)")
    return StageResult(NAME, SKIP, reason)

"""The same synthetic stages under ``torch.distributed.pipelining``'s own schedules, each beside the
project schedule holding the same stages; ``torch-interleaved`` (Megatron's placement with a virtual
pipeline of 2: the incumbent, which the executor does not run) is compared with its simulation.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from ..schedule import registry
from .synthetic import Spender, StageCosts, SyntheticStage, weight_runner

#: bench name -> (torch class name, project schedule with the same stages and costs)
TORCH_SCHEDULES: Dict[str, Tuple[str, str]] = {
    "torch-1f1b": ("Schedule1F1B", registry.EXECUTOR_1F1B),
    "torch-dualpipev": ("ScheduleDualPipeV", registry.DUALPIPEV),
    "torch-zbv": ("ScheduleZBVZeroBubble", registry.DUALPIPEV),
    "torch-interleaved": ("ScheduleInterleaved1F1B", registry.INTERLEAVED_1F1B),
}
#: The torch schedules whose order is the simulated one (ZBV's is not DualPipeV's).
SIMULATED_PEERS = ("torch-1f1b", "torch-dualpipev", "torch-interleaved")


def build_step(name: str, rank: int, pp: int, m: int, costs: StageCosts, spender: Spender,
               shape: Tuple[int, int]) -> Callable[[], None]:
    """Build this rank's stages and schedule; return a function running one iteration."""
    from torch.distributed import pipelining

    cls_name, _ = TORCH_SCHEDULES[name]
    v_shape = cls_name != "Schedule1F1B"  # two stages per rank
    num_stages = 2 * pp if v_shape else pp
    if cls_name == "ScheduleInterleaved1F1B":
        indices = [rank, rank + pp]
    else:
        indices = [rank, 2 * pp - 1 - rank] if v_shape else [rank]
    mbs, hidden = shape
    device = spender.device
    stages = []
    for s in indices:
        module = SyntheticStage(costs, spender, hidden)
        stages.append(pipelining.PipelineStage(module, s, num_stages, device, dw_builder=weight_runner(module)))
    loss_fn = lambda out, target: out.float().mean()  # noqa: E731 - costs nothing, as in the project
    cls = getattr(pipelining, cls_name)
    schedule = cls(stages if v_shape else stages[0], n_microbatches=m, loss_fn=loss_fn)
    has_first = 0 in indices
    has_last = num_stages - 1 in indices
    x = torch.zeros(m * mbs, hidden, device=device)
    target = torch.zeros(m * mbs, hidden, device=device)

    def step() -> None:
        args = (x,) if has_first else ()
        schedule.step(*args, target=target if has_last else None)

    return step

"""schedule.step_collectives against Megatron's own code: the collectives it says a rank issues
after the schedule, recorded from the megatron-core functions that issue them (one process, CPU
mode, ``torch.distributed.all_reduce`` recorded instead of run).

* The rerun state machine (``megatron.core.rerun_state_machine``), driven as Megatron-LM's
  ``train_step`` drives it for three iterations in each ``--rerun-mode``: as many all-reduces per
  iteration, over the default group, as the plan's ``rerun`` ops over ``default``.
"""
from __future__ import annotations

import pytest
import torch

from megatron_dualpipe.schedule import registry
from megatron_dualpipe.schedule import step_collectives as SC

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode (the state machine's tensors on 'cuda')")


@pytest.fixture
def recorded(monkeypatch):
    """torch.distributed.all_reduce's calls (their ``group``), none of them run; CPU mode on."""
    from megatron_dualpipe import cpu

    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *a, group=None, **k: calls.append(group))
    cpu.enable()
    try:
        yield calls
    finally:
        cpu.disable()


@pytest.mark.parametrize("mode", ["disabled", "validate_results", "report_determinism_stats"])
def test_the_rerun_state_machines_all_reduces_are_the_plans(recorded, mode):
    from megatron.core.rerun_state_machine import RerunMode, RerunStateMachine

    machine = RerunStateMachine(mode=RerunMode(mode))
    per_iteration = []
    for _ in range(3):  # Megatron-LM's train_step: the loop, then the exit check, then the step
        before = len(recorded)
        while machine.should_run_forward_backward(None):
            pass
        machine.should_checkpoint_and_exit()
        per_iteration.append(recorded[before:])
    layout = registry.get("dualpipe").layout(4)
    opts = SC.StepOptions(rerun=mode != "disabled")
    planned = [[op.group for op in ops if op.what == "rerun"] for ops in SC.programs(layout, opts, dp=2,
                                                                                     overlap_grad_reduce=True)]
    print(f"\n--rerun-mode {mode}: Megatron's all-reduces per iteration {per_iteration}; the plan's per rank {planned}")
    for groups in per_iteration:
        assert groups == [None] * len(groups)  # the default group
        assert all(p == ["default"] * len(groups) for p in planned)

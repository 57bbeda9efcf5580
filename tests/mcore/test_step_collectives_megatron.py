"""schedule.step_collectives against Megatron's own code: the collectives it says a rank issues
after the schedule, recorded from the megatron-core functions that issue them (one process, CPU
mode, ``torch.distributed.all_reduce`` recorded instead of run).

* The rerun state machine (``megatron.core.rerun_state_machine``), driven as Megatron-LM's
  ``train_step`` drives it for three iterations in each ``--rerun-mode``: as many all-reduces per
  iteration, over the default group, as the plan's ``rerun`` ops over ``default``.
* ``--log-params-norm``: Megatron-LM's own ``calc_params_l2_norm`` (``MEGATRON_LM_PATH``, in a
  subprocess: Megatron-LM's training code is not imported here) on a dense and an expert weight,
  the parallel groups stood in by named ones: its all-reduces are the plan's ``params-norm`` ops
  in the plan's order, or a part of them every member leaves out alike (core_v0.16.1), with the
  experts' model-parallel sum where that group differs (MoE) and only there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_dualpipe.schedule import registry
from megatron_dualpipe.schedule import step_collectives as SC

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode (the state machine's tensors on 'cuda')")


@pytest.fixture
def recorded(monkeypatch):
    """torch.distributed.all_reduce's calls (their ``group``), none of them run; CPU mode on (and
    off again after, unless an earlier test of this process left it on)."""
    from megatron_dualpipe import cpu

    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *a, group=None, **k: calls.append(group))
    was_on = cpu.active()
    cpu.enable()
    try:
        yield calls
    finally:
        if not was_on:
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


_PARAMS_NORM = textwrap.dedent(r"""
    import json, sys
    from types import SimpleNamespace
    from megatron_dualpipe.megatron_lm import triton_stub
    triton_stub.preimport_triton_users()
    from megatron_dualpipe import cpu, hooks
    hooks.install(["python"])  # typing.override for core_v0.19.0 on Python 3.11
    cpu.enable(megatron_lm=True)
    import torch
    try:
        from megatron.training.utils import common_utils as utils  # core_v0.19.0
    except ImportError:
        from megatron.training import utils
    from megatron.core import parallel_state
    from megatron.training import global_vars

    class Group:
        def __init__(self, name, ranks):
            self.name, self.ranks = name, ranks
        def rank(self):
            return 0
        def size(self):
            return len(self.ranks)

    apart = sys.argv[1] == "1"  # the experts' model-parallel group differs from the dense one
    groups = {"mp": [0, 1], "expt-mp": [0, 1, 2, 3] if apart else [0, 1], "tp": [0], "etp": [0],
              "dp-cp": [0, 2], "expt-dp": [0], "expt-gtp": [0]}
    groups = {name: Group(name, ranks) for name, ranks in groups.items()}
    for getter, name in {"get_model_parallel_group": "mp", "get_expert_tensor_model_pipeline_parallel_group": "expt-mp",
                         "get_tensor_model_parallel_group": "tp", "get_expert_tensor_parallel_group": "etp",
                         "get_data_parallel_group": "dp-cp", "get_expert_data_parallel_group": "expt-dp",
                         "get_expert_gtp_weight_remat_group": "expt-gtp"}.items():
        if hasattr(parallel_state, getter):
            setattr(parallel_state, getter, lambda *a, _g=groups[name], **k: _g)
    for getter in ("get_gtp_weight_remat_rank", "get_expert_gtp_weight_remat_rank", "get_tensor_model_parallel_rank",
                   "get_expert_tensor_parallel_rank"):
        if hasattr(parallel_state, getter):
            setattr(parallel_state, getter, lambda *a, **k: 0)
    calls = []
    torch.distributed.all_reduce = lambda t, *a, group=None, **k: calls.append(getattr(group, "name", None))
    torch.distributed.get_process_group_ranks = lambda g: g.ranks
    global_vars.set_args(SimpleNamespace(use_megatron_fsdp=False, bf16=False))
    dense, expert = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
    expert.weight.allreduce = False
    utils.calc_params_l2_norm([torch.nn.ModuleList([dense, expert])])
    print("CALLS" + json.dumps(calls))
""")


def _is_part_of(short, long):
    it = iter(long)
    return all(x in it for x in short)


@pytest.mark.parametrize("apart", [False, True], ids=["dense-mp-group", "expert-mp-group-apart"])
def test_the_params_norms_all_reduces_are_the_plans(apart):
    path = os.environ.get("MEGATRON_LM_PATH")
    if not path or not os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        pytest.skip("set MEGATRON_LM_PATH to a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, root]))
    proc = subprocess.run([sys.executable, "-c", _PARAMS_NORM, "1" if apart else "0"], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CALLS")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    megatron = json.loads(lines[-1][len("CALLS"):])
    shared = megatron
    layout = registry.get("dualpipe").layout(4)
    [ops, *_] = SC.programs(layout, SC.StepOptions(params_norm=True, moe=apart), dp=2, overlap_grad_reduce=True)
    planned = [op.group for op in ops if op.what.startswith("params-norm")]
    print(f"\ncalc_params_l2_norm ({os.path.basename(path.rstrip('/'))}, experts' group apart: {apart}): "
          f"{megatron}; the plan: {planned}")
    assert _is_part_of(shared, planned)
    # the model-parallel sums exactly (the plan's expert one with MoE, Megatron's where its group differs)
    assert [g for g in planned if g.endswith("mp")] == [g for g in shared if g.endswith("mp")]

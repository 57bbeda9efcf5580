"""What the first GPU check (one H100, torch 2.11.0) found, refused before anything starts:

* torch 2.11's ``torch.distributed.new_group`` has no ``sort_ranks``, which DualPipe's reversed
  pipeline group needs: there the selftest's ranks stopped with a TypeError. Now the selftest's
  settings check, the schedule's argument check and ``build_bd_groups`` name torch >= 2.12.
* On a one-GPU machine the selftest advised ``--nproc 1``, which it refuses: the advice now names
  a count that its own check accepts, or says that no count fits here.

An older torch is emulated by a ``new_group`` with torch 2.11's parameters.
"""
from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist

from megatron_dualpipe import versions
from megatron_dualpipe.selftest.options import check, default_world


def _torch_2_11_new_group(ranks=None, timeout=None, backend=None, pg_options=None,
                          use_local_synchronization=False, group_desc=None, device_id=None):
    raise AssertionError("no group may be built once the torch is refused")


@pytest.fixture
def torch_2_11(monkeypatch):
    monkeypatch.setattr(dist, "new_group", _torch_2_11_new_group)


def test_this_torch_builds_ordered_groups():
    assert "sort_ranks" in inspect.signature(dist.new_group).parameters
    assert versions.torch_problem() is None


def test_a_torch_without_ordered_groups_is_named_with_the_fix(torch_2_11):
    problem = versions.torch_problem()
    print(f"\n{problem}")
    assert problem and f"torch >= {versions.TORCH_FOR_TWO_CHUNKS}" in problem and "pip install" in problem
    selftest = check(4, 1, 1, False, False, False, 0, False)
    print(selftest)
    assert selftest == f"the selftest runs DualPipe, which {problem}"


def test_build_bd_groups_refuses_that_torch_before_any_group(torch_2_11):
    from megatron_dualpipe.mcore import groups

    with pytest.raises(RuntimeError, match=r"DualPipe's process groups: needs torch >= 2\.12"):
        groups.build_bd_groups()


GPU_COUNTS = [  # (ranks asked for, tp, ep, GPUs here) -> the advice must itself pass the check
    (4, 1, 1, 3), (8, 1, 2, 6), (8, 2, 1, 5), (16, 1, 1, 10),
]


@pytest.mark.parametrize("world,tp,ep,gpus", GPU_COUNTS)
def test_too_few_gpus_names_a_count_that_works(world, tp, ep, gpus):
    problem = check(world, tp, ep, False, False, True, gpus, False)
    print(f"\n{problem}")
    advised = int(problem.split("use --nproc ")[1].split(",")[0])
    assert advised <= gpus and check(advised, tp, ep, False, False, True, gpus, False) is None


def test_one_gpu_names_no_count_and_the_default_fits_the_gpus():
    problem = check(default_world(True, 1), 1, 1, False, False, True, 1, False)
    print(f"\n{problem}")
    assert "--nproc" not in problem and "needs 2" in problem
    assert [default_world(True, n) for n in (2, 3, 8, 9)] == [2, 2, 8, 8]


def test_torchrun_with_more_ranks_than_gpus_on_a_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    problem = check(2, 1, 1, False, False, True, 1, True)
    print(f"\n{problem}")
    assert problem.endswith("use --nproc-per-node 1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert check(2, 1, 1, False, False, True, 1, True) is None  # two nodes of one GPU each

"""What the launch script names when it refuses its sizes (megatron_dualpipe/launch_sizes.py): every
GPU count is whole nodes that Megatron accepts, checked over many node shapes and parallel sizes.
The rules are restated here (a multiple of TP*PP*CP and of ETP*EP*PP), not taken from the module."""
import math
import re

import pytest

from megatron_dualpipe import launch_sizes

NAMED = re.compile(r"(\d+) GPUs \(NNODES=(\d+) x GPUS_PER_NODE=(\d+)")


def launch(nodes, per_node, pp=4, tp=1, ep=1, etp=None, cp=1, micro=1, global_batch=1024, schedule="dualpipe",
           **model):
    return launch_sizes.Launch(nodes, per_node, pp, tp, cp, ep, etp, micro, global_batch, schedule, model)


def megatron_accepts(world, pp, tp, ep, etp, cp):
    dense, expert = tp * pp * cp, (etp or tp) * ep * pp
    return world % (dense * expert // math.gcd(dense, expert)) == 0


@pytest.mark.parametrize("sizes", [dict(pp=4), dict(pp=8, tp=2), dict(pp=4, ep=8), dict(pp=2, tp=2, ep=4, etp=1),
                                   dict(pp=6, cp=2)])
def test_every_gpu_count_named_is_whole_nodes_megatron_accepts(sizes):
    checked = 0
    for per_node in range(1, 13):
        for nodes in range(1, 6):
            found = launch_sizes.world_problem(launch(nodes, per_node, **sizes))
            if found is None:
                assert megatron_accepts(nodes * per_node, **{"tp": 1, "ep": 1, "etp": None, "cp": 1, **sizes})
                continue
            named = [tuple(map(int, m.groups())) for m in NAMED.finditer(found)][1:]  # the first: the given one
            if per_node == 6 and nodes == 2:
                print(f"\n{sizes}: {found}")
            assert named, found
            for count, n, g in named:
                assert count == n * g and g <= per_node, found
                assert megatron_accepts(count, **{"tp": 1, "ep": 1, "etp": None, "cp": 1, **sizes}), found
                checked += 1
    assert checked > 20


def test_the_nearest_count_on_these_nodes_keeps_their_size():
    """gpt_8b's sizes (PP=8 TP=2: 16 GPUs) on 2 nodes of 6: 48 GPUs as 8 such nodes, not 16 beside them."""
    found = launch_sizes.world_problem(launch(2, 6, pp=8, tp=2))
    print(f"\n{found}")
    assert "use 48 GPUs (NNODES=8 x GPUS_PER_NODE=6: the nearest valid count on nodes of 6 GPUs)" in found
    assert "16 GPUs" not in found

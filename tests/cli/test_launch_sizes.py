"""What the launch script names when it refuses its sizes (megatron_dualpipe/launch/sizes.py): every
GPU count is whole nodes that Megatron accepts, checked over many node shapes and parallel sizes.
The rules are restated here (a multiple of TP*PP*CP and of ETP*EP*PP), not taken from the module."""
import math
import re

import pytest

from megatron_dualpipe.launch import sizes as launch_sizes

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


def least_microbatches(schedule, pp):
    """The schedules' rule, restated: DualPipe and DualPipeV run at least pp micro-batches."""
    return pp if schedule in ("dualpipe", "dualpipev") else 1


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev", "zb-h1", "1f1b"])
def test_every_global_batch_named_is_the_nearest_valid_one(schedule):
    """Each GLOBAL_BATCH a batch refusal names is a multiple of MICRO_BATCH*DP with enough
    micro-batches, and no valid value lies closer to the one given."""
    checked = 0
    for micro in (1, 3, 4):
        for world in (4, 8, 12):
            for gb in range(1, 130, 7):
                found = launch_sizes.batch_problem(launch(1, world, pp=4, micro=micro, global_batch=gb,
                                                          schedule=schedule))
                unit, least = micro * world // 4, least_microbatches(schedule, 4)
                valid = [b for b in range(unit, 4 * gb + 8 * unit, unit) if b // unit >= least]
                if found is None:
                    assert gb in valid
                    continue
                named = [int(b) for b in re.findall(r"(?:GLOBAL_BATCH=|GLOBAL_BATCH to |or )(\d+) \(", found)]
                if (micro, world, gb) == (3, 8, 99):
                    print(f"\n{schedule}: {found}")
                assert named and all(b in valid for b in named), found
                closest = min(abs(b - gb) for b in valid)
                assert min(abs(b - gb) for b in named) == closest, found
                checked += 1
    assert checked > 50


def test_global_batch_100_with_micro_batch_3_names_96_and_102():
    """The issue's case: gpt_345m's PP=4 on 8 GPUs (DP=2), MICRO_BATCH=3: 6 per micro-batch step."""
    found = launch_sizes.batch_problem(launch(1, 8, pp=4, micro=3, global_batch=100))
    print(f"\n{found}")
    assert found == ("GLOBAL_BATCH=100 is not a multiple of MICRO_BATCH*DP=3*2=6: use GLOBAL_BATCH=96 "
                     "(16 micro-batches) or 102 (17 micro-batches, padded to 18)")


def test_too_few_micro_batches_names_the_least_and_the_filling_batch():
    found = launch_sizes.batch_problem(launch(1, 8, pp=4, micro=4, global_batch=8))
    print(f"\n{found}")
    assert "raise GLOBAL_BATCH to 32 (4 micro-batches, padded to 8); 8 micro-batches (GLOBAL_BATCH=64) fill" in found


#: PP, TP (EP) and the GLOBAL_BATCH where one is named, as a refusal names them for the GPUs given.
NAMED_SIZES = re.compile(r"PP=(\d+) TP=(\d+)(?: EP=(\d+))?(?: with GLOBAL_BATCH=(\d+))?")
#: Models as the launch script reads them from the config (gpt_8b's, Mixtral's, a 30-layer one).
MODELS = {"gpt_8b": dict(layers=32, heads=32, groups=8, gqa=1, ffn=14336),
          "mixtral": dict(layers=32, heads=32, groups=8, gqa=1, ffn=14336, experts=8),
          "odd": dict(layers=30, heads=24, ffn=4096)}


def schedule_accepts(schedule, pp, layers):
    """The schedules' rules, restated: DualPipe an even PP dividing the layers, DualPipeV 2*PP V-stages,
    the executor's schedules PP >= 2."""
    stages = 2 * pp if schedule == "dualpipev" else pp
    return layers % stages == 0 and (schedule != "dualpipe" or pp % 2 == 0) and (schedule == "1f1b" or pp >= 2)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev", "zb-h1", "1f1b"])
def test_every_pp_tp_ep_named_runs_on_the_gpus_given(model, schedule):
    """The sizes named for the GPUs given: Megatron's world rule, heads / query groups / MLP over TP
    within a node, experts over EP, the schedule's PP rules, and the batch (with the GLOBAL_BATCH named)."""
    m, checked = MODELS[model], 0
    for per_node in (2, 4, 6, 8):
        for nodes in (1, 2, 3):
            given = launch(nodes, per_node, pp=8, tp=2, ep=8 if "experts" in m else 1, global_batch=512,
                           schedule=schedule, **m)
            found = launch_sizes.world_problem(given)
            if found is None:
                continue
            named = [m2.groups() for m2 in NAMED_SIZES.finditer(found.partition("or keep ")[2])]
            if (per_node, nodes) == (8, 1):
                print(f"\n{model} {schedule}: {found}")
            world = nodes * per_node
            for pp, tp, ep, batch in [(int(a), int(b), int(c or 1), int(d or 512)) for a, b, c, d in named]:
                assert megatron_accepts(world, pp, tp, ep, None, 1), found
                assert schedule_accepts(schedule, pp, m["layers"]) and per_node % tp == 0, found
                assert m["heads"] % tp == 0 and m["ffn"] % tp == 0 and (m.get("groups", tp) % tp == 0), found
                assert m.get("experts", 1) % ep == 0, found
                unit = world // (pp * tp)
                assert batch % unit == 0 and batch // unit >= least_microbatches(schedule, pp), found
                checked += 1
    assert checked > 10

"""The launcher's ``--pair-placement``: every process rewrites ``RANK`` consistently (a permutation,
complete bd pairs per node, ``LOCAL_RANK`` untouched), refuses what cannot be placed before any
communication naming the fix, and runs under torchrun on a fake 2-node layout (two torchrun
agents with 2 processes each on this machine, gloo).

The pipeline rank of a global rank is computed here from Megatron's default order directly
(``(rank // (tp*dp)) % pp``), not through the module under test.
"""
import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest
from megatron_dualpipe.launch.ports import free_port

from megatron_dualpipe.launch import placement as launch_placement
from megatron_dualpipe.launch.placement import FLAG, TORCHRUN_RANK_ENV

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def script_args(pp=4, tp=1, schedule="dualpipe", *more):
    return ["--pipeline-model-parallel-size", str(pp), "--tensor-model-parallel-size", str(tp),
            "--pipeline-schedule", schedule, *more]


def torchrun_env(slot, nodes, per_node):
    """What torchrun sets in the process of ``slot`` (node by node)."""
    return {"RANK": str(slot), "LOCAL_RANK": str(slot % per_node), "GROUP_RANK": str(slot // per_node),
            "WORLD_SIZE": str(nodes * per_node), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_WORLD_SIZE": str(nodes)}


@pytest.mark.parametrize("nodes,per_node,pp,tp", [(2, 2, 4, 1), (4, 8, 8, 1), (8, 8, 8, 2), (2, 8, 4, 2)])
def test_every_process_rewrites_rank_to_one_permutation(nodes, per_node, pp, tp):
    world = nodes * per_node
    dp = world // (pp * tp)
    argv = script_args(pp, tp)
    got = {}
    for slot in range(world):
        env = torchrun_env(slot, nodes, per_node)
        assert launch_placement.apply(argv, env) == (slot, int(env["RANK"]))
        assert env["LOCAL_RANK"] == str(slot % per_node) and env[TORCHRUN_RANK_ENV] == str(slot)
        got[slot] = int(env["RANK"])
    assert sorted(got.values()) == list(range(world)) and got[0] == 0
    stage = {g: (g // (tp * dp)) % pp for g in range(world)}
    for n in range(nodes):
        stages = [stage[got[s]] for s in range(n * per_node, (n + 1) * per_node)]
        print(f"node {n}: pipeline ranks {stages}")
        for i in set(stages):
            assert stages.count(i) == stages.count(pp - 1 - i)  # as many copies of stage i as of its partner


@pytest.mark.parametrize("argv,env,words", [
    (script_args(4, 1, "dualpipev"), torchrun_env(0, 2, 2), "--pipeline-schedule dualpipev has none: drop"),
    (script_args(4, 1, "1f1b"), torchrun_env(0, 2, 2), "has none"),
    (script_args(4, 1), {"RANK": "0", "LOCAL_RANK": "0"}, "run the launcher under torchrun"),
    (script_args(8, 8), torchrun_env(0, 8, 8), "split the tensor-parallel groups of 8"),
    (script_args(4, 1), dict(torchrun_env(0, 2, 2), GROUP_WORLD_SIZE="3"), "same number of processes on every node"),
    (script_args(4, 1) + ["--yaml-cfg", "x.yaml"], torchrun_env(0, 2, 2), "not from --yaml-cfg"),
    (script_args(4, 1), dict(torchrun_env(1, 2, 2), LOCAL_RANK="0"), "not numbered node by node"),
    (script_args(4, 1) + ["--tensor-model-parallel-size", "x"], torchrun_env(0, 2, 2), "expected a positive integer"),
])
def test_what_cannot_be_placed_is_refused_before_anything_changes(argv, env, words):
    before = dict(env)
    with pytest.raises(ValueError) as e:
        launch_placement.apply(argv, env)
    print(f"\n{e.value}")
    assert words in str(e.value) and env == before


def test_rank_is_rewritten_once():
    env = torchrun_env(1, 2, 2)
    launch_placement.apply(script_args(), env)
    with pytest.raises(ValueError, match="rewritten already"):
        launch_placement.apply(script_args(), env)


def test_torchrun_two_fake_nodes_hold_the_bd_pairs(tmp_path):
    """Two torchrun agents (node ranks 0 and 1, 2 processes each) on this machine: gloo starts with
    the rewritten ranks, rank 0 sees every process, and each node holds pipeline ranks i and 3-i."""
    out = tmp_path / "ranks.json"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", TORCHRUN_RANK_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                str(n), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                                str(port), str(HERE / "pair_placement_worker.py"), str(out), *script_args(4, 1)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for n in (0, 1)]
    logs = []
    for a in agents:
        try:
            logs.append(a.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for b in agents:
                b.kill()
            pytest.fail("torchrun did not finish in 240 s:\n" + "\n".join(x.communicate()[0] for x in agents))
    print("\n" + "\n".join(logs))
    assert all(a.returncode == 0 for a in agents), logs
    rows = json.loads(out.read_text())
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3]
    assert all(r["rank"] == r["dist_rank"] and r["local_rank"] == r["local_rank_before"] for r in rows)
    by_node = {}
    for r in rows:
        assert r["slot"] // 2 == r["group_rank"]
        by_node.setdefault(r["group_rank"], set()).add(r["rank"] % 4)  # pp=4, tp=dp=1: pipeline rank = rank
    print(f"pipeline ranks per node: {by_node}")
    assert by_node == {0: {0, 3}, 1: {1, 2}}
    assert "the bd pairs share nodes" in logs[0] and "node 1: pipeline ranks 1, 2" in logs[0]


def _script(tmp_path, **env):
    """The launch script's dry run with a stand-in checkout and data (``test_scripts.run``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_launch_script_tests", HERE / "test_scripts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(tmp_path, **env)


def test_launch_script_passes_the_flag_and_checks_it_first(tmp_path):
    r = _script(tmp_path, CONFIG="gpt_8b", NNODES=4, GPUS_PER_NODE=4, MASTER_ADDR="node0", PAIR_PLACEMENT=1)
    assert r.returncode == 0, r.stderr
    header, command = r.stdout.strip().splitlines()[-2:]
    argv = shlex.split(command)
    print(f"\n{header}")
    assert argv[argv.index("megatron_dualpipe.launch") + 1] == FLAG and "bd pairs on one node" in header
    # TP=2 on nodes of 2 GPUs: a node cannot hold both halves of a pair without splitting TP
    r = _script(tmp_path, CONFIG="gpt_8b", NNODES=8, GPUS_PER_NODE=2, MASTER_ADDR="node0", PAIR_PLACEMENT=1)
    print(r.stderr.strip())
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "split the tensor-parallel groups of 2" in r.stderr and "drop --pair-placement" in r.stderr
    r = _script(tmp_path, CONFIG="gpt_345m", SCHEDULE="dualpipev", GPUS_PER_NODE=4, PAIR_PLACEMENT=1)
    assert r.returncode == 2 and "has none" in r.stderr
    r = _script(tmp_path, CONFIG="gpt_345m", PAIR_PLACEMENT="yes")
    assert r.returncode == 2 and "PAIR_PLACEMENT=yes" in r.stderr

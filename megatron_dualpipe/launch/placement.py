"""``--pair-placement``: the launcher puts pipeline ranks i and pp-1-i on the same node.

torchrun numbers the processes node by node (``RANK = GROUP_RANK * LOCAL_WORLD_SIZE +
LOCAL_RANK``) and Megatron takes ``RANK`` as its global rank, so Megatron's order decides which
node a pipeline stage lands on: the ranks of one stage are consecutive, and DualPipe's bd sum
(stage i's two copies, on pipeline ranks i and pp-1-i) crosses the link between nodes. With
``python -m megatron_dualpipe.launch --pair-placement pretrain_gpt.py ...`` each process, before
Megatron reads its environment (and so before any communication), replaces ``RANK`` by
``pair_placement(...)[RANK]`` (:mod:`megatron_dualpipe.schedule.placement`, a pure function every
process computes alike), so each node hosts complete bd pairs. ``LOCAL_RANK`` (the GPU) and
Megatron's rank order (which global rank has which tensor, data and pipeline rank) stay as they
are; rank 0 stays rank 0. torchrun's own ``RANK`` is kept in :data:`TORCHRUN_RANK_ENV`.

The parallel sizes come from the script's arguments (Megatron's flags, the last one wins as with
argparse), the world and node sizes from torchrun's environment; every problem is one line naming
the fix (:func:`problem`). Only schedules with bd pairs (``dualpipe``) take it: for the others it
would only move pipeline neighbours apart.
"""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

from ..schedule import registry
from ..schedule.placement import DEFAULT_ORDER, TP_PP_DP_ORDER, RankOrder, pair_placement, pair_problem

FLAG = "--pair-placement"
#: torchrun's ``RANK`` (the slot) before the rewrite.
TORCHRUN_RANK_ENV = "MEGATRON_DUALPIPE_TORCHRUN_RANK"
#: Nodes listed in the node map slot 0 prints.
MAX_NODES_SHOWN = 8

_SIZES = {"--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
          "--context-parallel-size": "cp", "--expert-model-parallel-size": "ep",
          "--expert-tensor-parallel-size": "etp"}


def script_sizes(argv: Sequence[str]) -> Tuple[Dict[str, object], Optional[str]]:
    """The parallel sizes, rank order and schedule in a Megatron script's arguments, or a problem."""
    found: Dict[str, object] = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": None, "order": DEFAULT_ORDER,
                                "schedule": registry.ONE_F_ONE_B}
    args = list(argv)
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if flag == "--yaml-cfg":
            return found, (f"{FLAG} reads the parallel sizes from the command line, not from --yaml-cfg: pass "
                           f"them as flags")
        if flag in _SIZES or flag == "--pipeline-schedule":
            text = val if eq else (args[i + 1] if i + 1 < len(args) else "")
            if flag == "--pipeline-schedule":
                found["schedule"] = text
                continue
            if not text.isdigit() or int(text) < 1:
                return found, f"{flag} {text!r}: expected a positive integer"
            found[_SIZES[flag]] = int(text)
        elif a == "--use-tp-pp-dp-mapping":
            found["order"] = TP_PP_DP_ORDER
    return found, None


def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
    text = env.get(name)
    return int(text) if text is not None and text.strip().isdigit() else None


def problem(argv: Sequence[str], env: Mapping[str, str]) -> Optional[str]:
    """Why ``--pair-placement`` cannot run with these script arguments under this torchrun
    environment (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), or None."""
    sizes, bad = script_sizes(argv)
    if bad:
        return bad
    name = str(sizes["schedule"])
    try:
        spec = registry.get(name)
    except registry.ScheduleError:
        return None  # Megatron's own argument check names the unknown schedule
    if not spec.mirrored:
        return (f"{FLAG} places the bd pairs (pipeline ranks i and pp-1-i) of --pipeline-schedule "
                f"{' or '.join(registry.names(mirrored=True))} side by side; --pipeline-schedule {name} has none: "
                f"drop {FLAG}")
    world, per_node = _env_int(env, "WORLD_SIZE"), _env_int(env, "LOCAL_WORLD_SIZE")
    if world is None or per_node is None:
        return (f"{FLAG} needs torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE (GPUs per node): run the launcher "
                f"under torchrun")
    nodes = _env_int(env, "GROUP_WORLD_SIZE")
    if nodes is not None and nodes * per_node != world:
        return (f"{FLAG} needs the same number of processes on every node: WORLD_SIZE={world} is not "
                f"GROUP_WORLD_SIZE={nodes} x LOCAL_WORLD_SIZE={per_node}")
    tp, cp, pp = int(sizes["tp"]), int(sizes["cp"]), int(sizes["pp"])
    if world % (tp * cp * pp):
        return None  # Megatron refuses it, naming the sizes
    return pair_problem(world, per_node, tp, cp, world // (tp * cp * pp), pp, str(sizes["order"]),
                        int(sizes["ep"]), sizes["etp"])


def placement(argv: Sequence[str], env: Mapping[str, str]) -> List[int]:
    """``perm[slot]``: the Megatron global rank of every torchrun slot (``problem`` must be None)."""
    sizes, _ = script_sizes(argv)
    world, per_node = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    tp, cp, pp = int(sizes["tp"]), int(sizes["cp"]), int(sizes["pp"])
    return pair_placement(world, per_node, tp, cp, world // (tp * cp * pp), pp, str(sizes["order"]),
                          int(sizes["ep"]), sizes["etp"])


def apply(argv: Sequence[str], env: MutableMapping[str, str]) -> Tuple[int, int]:
    """Rewrite ``env["RANK"]`` to this slot's Megatron global rank; returns (slot, global rank).
    Raises ``ValueError`` naming the fix (nothing is changed then)."""
    found = problem(argv, env)
    if found:
        raise ValueError(found)
    slot = _env_int(env, "RANK")
    local, node = _env_int(env, "LOCAL_RANK"), _env_int(env, "GROUP_RANK")
    per_node = int(env["LOCAL_WORLD_SIZE"])
    if slot is None or local is None:
        raise ValueError(f"{FLAG} needs torchrun's RANK and LOCAL_RANK: run the launcher under torchrun")
    if TORCHRUN_RANK_ENV in env:
        raise ValueError(f"{FLAG}: RANK was rewritten already in this process ({TORCHRUN_RANK_ENV} is set)")
    if slot % per_node != local or (node is not None and slot // per_node != node):
        raise ValueError(f"{FLAG}: torchrun's RANK={slot} is not GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK "
                         f"({node} x {per_node} + {local}): the ranks are not numbered node by node here, so which "
                         f"node a rank is on is unknown; drop {FLAG}")
    rank = placement(argv, env)[slot]
    env[TORCHRUN_RANK_ENV] = str(slot)
    env["RANK"] = str(rank)
    return slot, rank


def describe(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """One line per node: the pipeline ranks it hosts (printed by slot 0)."""
    sizes, _ = script_sizes(argv)
    perm = placement(argv, env)
    world, per_node = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    tp, cp, pp = int(sizes["tp"]), int(sizes["cp"]), int(sizes["pp"])
    order = RankOrder(tp, cp, world // (tp * cp * pp), pp, str(sizes["order"]))
    lines = []
    nodes = world // per_node
    for n in range(min(nodes, MAX_NODES_SHOWN)):
        stages = sorted({order.pp_rank(g) for g in perm[n * per_node:(n + 1) * per_node]})
        lines.append(f"node {n}: pipeline ranks {', '.join(map(str, stages))} (global ranks "
                     f"{', '.join(map(str, perm[n * per_node:(n + 1) * per_node]))})")
    if nodes > MAX_NODES_SHOWN:
        lines.append(f"... ({nodes - MAX_NODES_SHOWN} more nodes, the same pattern)")
    return "\n".join(lines)


def apply_from_launcher(argv: Sequence[str]) -> None:
    """What ``launcher.main`` does with ``--pair-placement``: rewrite ``os.environ``, slot 0 prints the
    node map."""
    slot, rank = apply(argv, os.environ)
    if slot == 0:
        print(f"[megatron-dualpipe] {FLAG}: the bd pairs share nodes\n{describe(argv, os.environ)}", flush=True)

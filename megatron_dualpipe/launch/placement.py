"""``--pair-placement``: put pipeline ranks i and pp-1-i (DualPipe's bd pairs) on the same node.
torchrun numbers processes node by node and Megatron takes ``RANK`` as its global rank, so before
Megatron reads it each process replaces ``RANK`` by ``pair_placement(...)[RANK]`` (a pure function
every process computes alike), keeping torchrun's in :data:`TORCHRUN_RANK_ENV`.
"""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

from ..schedule import registry
from ..schedule.placement import DEFAULT_ORDER, TP_PP_DP_ORDER, RankOrder, pair_placement, pair_problem
from .checks import flag_values

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
    for flag, text in flag_values(list(argv), {*_SIZES, "--yaml-cfg", "--pipeline-schedule"}):
        if flag == "--yaml-cfg":
            return found, (f"{FLAG} reads the parallel sizes from the command line, not from --yaml-cfg: pass "
                           f"them as flags")
        if flag == "--pipeline-schedule":
            found["schedule"] = text
        elif not text.isdigit() or int(text) < 1:
            return found, f"{flag} {text!r}: expected a positive integer"
        else:
            found[_SIZES[flag]] = int(text)
    if "--use-tp-pp-dp-mapping" in argv:
        found["order"] = TP_PP_DP_ORDER
    return found, None


def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
    text = env.get(name)
    return int(text) if text is not None and text.strip().isdigit() else None


def problem(argv: Sequence[str], env: Mapping[str, str]) -> Optional[str]:
    """Why ``--pair-placement`` cannot run with these arguments under this torchrun environment, or None."""
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
    if world % (int(sizes["tp"]) * int(sizes["cp"]) * int(sizes["pp"])):
        return None  # Megatron refuses it, naming the sizes
    return pair_problem(*_grid(sizes, world, per_node))


def _grid(sizes: Dict[str, object], world: int, per_node: int) -> tuple:
    """``pair_placement``'s arguments: world, per node, tp, cp, dp, pp, order, ep, etp."""
    tp, cp, pp = int(sizes["tp"]), int(sizes["cp"]), int(sizes["pp"])
    return world, per_node, tp, cp, world // (tp * cp * pp), pp, str(sizes["order"]), int(sizes["ep"]), sizes["etp"]


def placement(argv: Sequence[str], env: Mapping[str, str]) -> List[int]:
    """``perm[slot]``: the Megatron global rank of every torchrun slot (``problem`` must be None)."""
    return pair_placement(*_grid(script_sizes(argv)[0], int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])))


def apply(argv: Sequence[str], env: MutableMapping[str, str]) -> Tuple[int, int]:
    """Rewrite ``env["RANK"]`` to this slot's global rank: (slot, rank), or ``ValueError`` naming the fix."""
    if found := problem(argv, env):
        raise ValueError(found)
    slot, local, node = (_env_int(env, name) for name in ("RANK", "LOCAL_RANK", "GROUP_RANK"))
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
    perm = placement(argv, env)
    world, per_node, *grid = _grid(script_sizes(argv)[0], int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"]))
    order, nodes = RankOrder(*grid[:5]), world // per_node
    hosted = [perm[n * per_node:(n + 1) * per_node] for n in range(min(nodes, MAX_NODES_SHOWN))]
    lines = [f"node {n}: pipeline ranks {', '.join(map(str, sorted({order.pp_rank(g) for g in ranks})))} (global "
             f"ranks {', '.join(map(str, ranks))})" for n, ranks in enumerate(hosted)]
    if nodes > MAX_NODES_SHOWN:
        lines.append(f"... ({nodes - MAX_NODES_SHOWN} more nodes, the same pattern)")
    return "\n".join(lines)


def apply_from_launcher(argv: Sequence[str]) -> None:
    """``--pair-placement`` in the launcher: rewrite ``os.environ``; slot 0 prints the node map."""
    slot, rank = apply(argv, os.environ)
    if slot == 0:
        print(f"[megatron-dualpipe] {FLAG}: the bd pairs share nodes\n{describe(argv, os.environ)}", flush=True)

"""The launch script's GPU count and batch, each refusal naming values that pass.

``scripts/pretrain_gpt_dualpipe.sh`` refuses, before any process starts, a world size Megatron
would refuse (not a multiple of TP*PP*CP and of ETP*EP*PP), an EP that does not divide the
experts, and a global batch Megatron or the schedule would refuse. A refusal that says "change
PP, TP" or names a GPU count the nodes cannot hold leaves the user to search; each count named
here is a multiple of the parallel sizes' unit and of its own GPUS_PER_NODE, with the NNODES to use.

``python -m megatron_dualpipe.launch_sizes --nodes N --gpus-per-node G --pp P --tp T --cp C --ep E
[--etp X] --micro-batch B --global-batch GB --schedule S -- PRETRAIN_GPT_ARGS...`` prints
``MIN_GPUS DP MICRO_BATCHES`` (exit 0), or the one problem naming the fix (exit 2). Standard
library only: the script runs it before the training environment is checked.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from .launch_validation import fewest_gpus
from .schedule import registry

#: pretrain_gpt.py flags read from the arguments (the last one wins, as with argparse).
_MODEL_FLAGS = {"--num-experts": "experts"}


@dataclass(frozen=True)
class Launch:
    """The launch script's variables (ETP None: TP) and the model arguments this module reads."""

    nodes: int
    per_node: int
    pp: int
    tp: int
    cp: int
    ep: int
    etp: Optional[int]
    micro: int
    global_batch: int
    schedule: str
    model: Dict[str, int]

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def unit(self, pp: Optional[int] = None, tp: Optional[int] = None, ep: Optional[int] = None) -> int:
        """The fewest GPUs these parallel sizes (or the ones given instead) need: Megatron's rule."""
        pp, tp, ep = pp or self.pp, tp or self.tp, ep or self.ep
        return fewest_gpus(argparse.Namespace(
            pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, context_parallel_size=self.cp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=self.etp or tp))


def model_values(argv: Sequence[str]) -> Dict[str, int]:
    """The integer values of :data:`_MODEL_FLAGS` in ``argv`` (absent ones left out)."""
    found: Dict[str, int] = {}
    for i, a in enumerate(argv):
        flag, eq, val = a.partition("=")
        text = val if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if flag in _MODEL_FLAGS and text.isdigit():
            found[_MODEL_FLAGS[flag]] = int(text)
    return found


# ---------------------------------------------------------------------------------------------
# The GPU count
# ---------------------------------------------------------------------------------------------

def _layout(count: int, nodes: int, per_node: int) -> str:
    return f"{count} GPUs (NNODES={nodes} x GPUS_PER_NODE={per_node})"


def valid_counts(world: int, nodes: int, per_node: int, unit: int) -> str:
    """The GPU counts to use instead of ``world``: the nearest multiple of ``unit`` on nodes of
    ``per_node`` GPUs, and, where one exists, ``nodes`` nodes with fewer GPUs each."""
    step = unit * per_node // math.gcd(unit, per_node)  # a multiple of the unit on whole nodes
    below = world // step * step
    nearest = below if below > 0 and world - below <= below + step - world else below + step
    text = f"use {nearest} GPUs (NNODES={nearest // per_node} x GPUS_PER_NODE={per_node}: the nearest valid count " \
        f"on nodes of {per_node} GPUs)"
    fewer = [k for k in range(per_node - 1, 0, -1) if (k * nodes) % unit == 0]
    if fewer:
        text += f", or {fewer[0] * nodes} GPUs (NNODES={nodes} x GPUS_PER_NODE={fewer[0]}: {fewer[0]} of each node's {per_node})"
    return text


def world_problem(launch: Launch) -> Optional[str]:
    """Why Megatron would refuse the world size, naming the GPU counts that work, or None."""
    unit, world = launch.unit(), launch.world
    if world % unit == 0:
        return None
    etp = launch.etp or launch.tp
    return (f"{_layout(world, launch.nodes, launch.per_node)}: Megatron needs a multiple of "
            f"TP*PP*CP={launch.tp * launch.pp * launch.cp} and of ETP*EP*PP={etp * launch.ep * launch.pp}, "
            f"i.e. of {unit}: {valid_counts(world, launch.nodes, launch.per_node, unit)}, or change PP, TP, EP, "
            f"CP, ETP")


def experts_problem(launch: Launch) -> Optional[str]:
    """Why Megatron would refuse EP for the model's experts, or None."""
    experts = launch.model.get("experts")
    if experts is None or experts % launch.ep == 0:
        return None
    return f"EP={launch.ep} does not divide the config's {experts} experts: use an EP that divides {experts}"


# ---------------------------------------------------------------------------------------------
# The batch
# ---------------------------------------------------------------------------------------------

def batch_problem(launch: Launch) -> Optional[str]:
    """Why Megatron or the schedule would refuse GLOBAL_BATCH, or None."""
    dp = launch.world // (launch.tp * launch.pp * launch.cp)
    unit = launch.micro * dp
    if launch.global_batch % unit:
        return f"GLOBAL_BATCH={launch.global_batch} is not a multiple of MICRO_BATCH*DP={unit}"
    m = launch.global_batch // unit
    if launch.schedule.startswith(registry.DUALPIPE) and m < launch.pp:
        return (f"{launch.schedule} needs at least PP={launch.pp} micro-batches per iteration, got "
                f"GLOBAL_BATCH/(MICRO_BATCH*DP)={m}: raise GLOBAL_BATCH to {launch.pp * unit}")
    return None


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse(argv: Sequence[str]) -> Launch:
    """The launch script's call: its variables as options, then ``--`` and pretrain_gpt.py's arguments."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m megatron_dualpipe.launch_sizes")
    for name in ("nodes", "gpus-per-node", "pp", "tp", "cp", "ep", "micro-batch", "global-batch"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--etp", type=int)
    p.add_argument("--schedule", required=True)
    a = p.parse_args(argv[:cut])
    return Launch(a.nodes, a.gpus_per_node, a.pp, a.tp, a.cp, a.ep, a.etp, a.micro_batch, a.global_batch,
                  a.schedule, model_values(argv[cut + 1:]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    launch = parse(sys.argv[1:] if argv is None else argv)
    problem = world_problem(launch) or experts_problem(launch) or batch_problem(launch)
    if problem:
        print(problem)
        return 2
    dp = launch.world // (launch.tp * launch.pp * launch.cp)
    print(launch.unit(), dp, launch.global_batch // (launch.micro * dp))
    return 0


if __name__ == "__main__":
    sys.exit(main())

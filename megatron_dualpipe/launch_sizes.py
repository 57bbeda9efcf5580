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
from typing import Dict, List, Optional, Sequence, Tuple

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
# The batch
# ---------------------------------------------------------------------------------------------

def valid_batches(global_batch: int, unit: int, least: int) -> List[int]:
    """The valid GLOBAL_BATCH values next to ``global_batch`` (below, above): multiples of ``unit``
    (MICRO_BATCH*DP) of at least ``least`` micro-batches."""
    below, above = global_batch // unit * unit, -(-global_batch // unit) * unit
    return sorted({max(below, least * unit), max(above, least * unit)})


def nearest_batch(global_batch: int, unit: int, least: int) -> int:
    """The valid GLOBAL_BATCH nearest to ``global_batch`` (the lower one on a tie)."""
    return min(valid_batches(global_batch, unit, least), key=lambda b: (abs(b - global_batch), b))


def batch_rule(launch: Launch, world: int, pp: int, tp: int) -> Tuple[int, int]:
    """(MICRO_BATCH*DP, the fewest micro-batches the schedule runs) on ``world`` GPUs with these
    sizes: GLOBAL_BATCH must be a multiple of the first (Megatron), of at least the second
    (the registry's rule, e.g. PP for DualPipe)."""
    return launch.micro * (world // (tp * pp * launch.cp)), registry.get(launch.schedule).min_real_microbatches(pp)


def _passes(global_batch: int, unit: int, least: int) -> bool:
    return global_batch % unit == 0 and global_batch // unit >= least


def batch_fix(launch: Launch, world: int, pp: int, tp: int) -> str:
    """'' where GLOBAL_BATCH passes on ``world`` GPUs with these sizes, else the GLOBAL_BATCH to use."""
    unit, least = batch_rule(launch, world, pp, tp)
    if _passes(launch.global_batch, unit, least):
        return ""
    return f" with GLOBAL_BATCH={nearest_batch(launch.global_batch, unit, least)}"


def _counted(launch: Launch, batch: int, unit: int) -> str:
    """``batch`` with its micro-batches per iteration, and the padding the executor adds."""
    spec, m = registry.get(launch.schedule), batch // unit
    padded = spec.padded_microbatches(launch.pp, m) if spec.runs_on == registry.EXECUTOR else m
    return f"{batch} ({m} micro-batch{'es' if m != 1 else ''}{f', padded to {padded}' if padded != m else ''})"


def batch_problem(launch: Launch) -> Optional[str]:
    """Why Megatron or the schedule would refuse GLOBAL_BATCH, naming the nearest valid ones, or None."""
    unit, least = batch_rule(launch, launch.world, launch.pp, launch.tp)
    gb, dp, m = launch.global_batch, unit // launch.micro, launch.global_batch // unit
    if _passes(gb, unit, least):
        return None
    batches = valid_batches(gb, unit, least)
    use = " or ".join(_counted(launch, b, unit) for b in batches)
    spec = registry.get(launch.schedule)
    fill = spec.min_microbatches(launch.pp)
    filled = (f"; {fill} micro-batches (GLOBAL_BATCH={fill * unit}) fill the pipeline"
              if spec.runs_on == registry.EXECUTOR and batches[0] // unit < fill else "")
    if gb % unit:
        return (f"GLOBAL_BATCH={gb} is not a multiple of MICRO_BATCH*DP={launch.micro}*{dp}={unit}: use "
                f"GLOBAL_BATCH={use}{filled}")
    return (f"{launch.schedule} needs at least {least} micro-batches per iteration with PP={launch.pp}, got "
            f"GLOBAL_BATCH/(MICRO_BATCH*DP)={m}: raise GLOBAL_BATCH to {use}{filled}")


# ---------------------------------------------------------------------------------------------
# The GPU count
# ---------------------------------------------------------------------------------------------

def valid_counts(launch: Launch) -> str:
    """The GPU counts to use instead of the world size: the nearest multiple of the unit on nodes
    of GPUS_PER_NODE, and, where one exists, NNODES nodes with fewer GPUs each; each with the
    GLOBAL_BATCH to use where the given one would not pass there."""
    world, nodes, per_node, unit = launch.world, launch.nodes, launch.per_node, launch.unit()
    step = unit * per_node // math.gcd(unit, per_node)  # a multiple of the unit on whole nodes
    below = world // step * step
    nearest = below if below > 0 and world - below <= below + step - world else below + step
    text = (f"use {nearest} GPUs (NNODES={nearest // per_node} x GPUS_PER_NODE={per_node}: the nearest valid count "
            f"on nodes of {per_node} GPUs){batch_fix(launch, nearest, launch.pp, launch.tp)}")
    fewer = [k for k in range(per_node - 1, 0, -1) if (k * nodes) % unit == 0]
    if fewer:
        k = fewer[0]
        text += (f", or {k * nodes} GPUs (NNODES={nodes} x GPUS_PER_NODE={k}: {k} of each node's {per_node})"
                 f"{batch_fix(launch, k * nodes, launch.pp, launch.tp)}")
    return text


def world_problem(launch: Launch) -> Optional[str]:
    """Why Megatron would refuse the world size, naming the GPU counts that work, or None."""
    unit, world = launch.unit(), launch.world
    if world % unit == 0:
        return None
    etp = launch.etp or launch.tp
    return (f"{world} GPUs (NNODES={launch.nodes} x GPUS_PER_NODE={launch.per_node}): Megatron needs a multiple of "
            f"TP*PP*CP={launch.tp * launch.pp * launch.cp} and of ETP*EP*PP={etp * launch.ep * launch.pp}, "
            f"i.e. of {unit}: {valid_counts(launch)}, or change PP, TP, EP, "
            f"CP, ETP")


def experts_problem(launch: Launch) -> Optional[str]:
    """Why Megatron would refuse EP for the model's experts, or None."""
    experts = launch.model.get("experts")
    if experts is None or experts % launch.ep == 0:
        return None
    return f"EP={launch.ep} does not divide the config's {experts} experts: use an EP that divides {experts}"


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

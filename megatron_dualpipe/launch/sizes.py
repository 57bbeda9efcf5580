"""The launch script's GPU count and batch, each refusal naming values that pass every rule (GPU
counts on whole nodes, PP, TP and EP for the GPUs given, the nearest valid GLOBAL_BATCH): "change PP,
TP" would leave the user to search. Prints ``MIN_GPUS DP MICRO_BATCHES`` or the problem (exit 2).
Standard library only: the script runs it before the training environment is checked.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule import registry
from .checks import flag_values
from .validation import fewest_gpus

#: pretrain_gpt.py flags read from the arguments (the last one wins, as with argparse).
_MODEL_FLAGS = {"--num-experts": "experts", "--num-layers": "layers", "--num-attention-heads": "heads",
                "--num-query-groups": "groups", "--ffn-hidden-size": "ffn",
                "--num-layers-per-virtual-pipeline-stage": "vpp_layers"}
#: Flags whose presence is read (as 1); an uneven split of the layers keeps PP as given.
_MODEL_SWITCHES = {"--group-query-attention": "gqa", **{f"--{flag}": "uneven" for flag in (
    "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers", "pipeline-model-parallel-layout",
    "account-for-embedding-in-pipeline-split", "account-for-loss-in-pipeline-split")}}
#: Parallel-size options named per refusal, and the largest world searched for them.
SIZES_NAMED, SIZES_WORLD_LIMIT = 2, 1 << 20


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
    """The integer values of :data:`_MODEL_FLAGS` in ``argv``, and 1 for :data:`_MODEL_SWITCHES` present."""
    found = {_MODEL_FLAGS[flag]: int(text) for flag, text in flag_values(argv, _MODEL_FLAGS) if text.isdigit()}
    return {**found, **{_MODEL_SWITCHES[flag]: 1 for flag, _ in flag_values(argv, _MODEL_SWITCHES)}}


# The batch

def valid_batches(global_batch: int, unit: int, least: int) -> List[int]:
    """The valid GLOBAL_BATCH values below and above ``global_batch``: multiples of ``unit``, >= ``least`` of it."""
    below, above = global_batch // unit * unit, -(-global_batch // unit) * unit
    return sorted({max(below, least * unit), max(above, least * unit)})


def batch_rule(launch: Launch, world: int, pp: int, tp: int) -> Tuple[int, int, bool]:
    """(MICRO_BATCH*DP, the fewest micro-batches the schedule runs): GLOBAL_BATCH's two rules; whether it passes."""
    unit = launch.micro * (world // (tp * pp * launch.cp))
    least = registry.get(launch.schedule).min_real_microbatches(pp)
    return unit, least, launch.global_batch % unit == 0 and launch.global_batch // unit >= least


def batch_fix(launch: Launch, world: int, pp: int, tp: int) -> str:
    """'' where GLOBAL_BATCH passes on ``world`` GPUs with these sizes, else the GLOBAL_BATCH to use."""
    unit, least, passes = batch_rule(launch, world, pp, tp)
    if passes:
        return ""
    nearest = min(valid_batches(launch.global_batch, unit, least), key=lambda b: (abs(b - launch.global_batch), b))
    return f" with GLOBAL_BATCH={nearest}"  # the lower one on a tie


def _counted(launch: Launch, batch: int, unit: int) -> str:
    """``batch`` with its micro-batches per iteration, and the padding the executor adds."""
    spec, m = registry.get(launch.schedule), batch // unit
    padded = spec.padded_microbatches(launch.pp, m) if spec.runs_on == registry.EXECUTOR else m
    return f"{batch} ({m} micro-batch{'es' if m != 1 else ''}{f', padded to {padded}' if padded != m else ''})"


def batch_problem(launch: Launch) -> Optional[str]:
    """Why Megatron or the schedule would refuse GLOBAL_BATCH, naming the nearest valid ones, or None."""
    unit, least, passes = batch_rule(launch, launch.world, launch.pp, launch.tp)
    gb, dp, m = launch.global_batch, unit // launch.micro, launch.global_batch // unit
    if passes:
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


# PP, TP and EP for the GPUs given

def _divisors(n: int) -> List[int]:
    return sorted({d for k in range(1, math.isqrt(n) + 1) if n % k == 0 for d in (k, n // k)})


def pp_fits(launch: Launch, pp: int) -> bool:
    """Whether the schedule runs on ``pp`` stages and the layers divide into them (unless uneven)."""
    spec, model = registry.get(launch.schedule), launch.model
    vpp = model.get("vpp_layers")
    if spec.pp_problem(pp) or (pp < 2 and (spec.runs_on == registry.EXECUTOR or vpp)):
        return False
    if model.get("uneven") or "layers" not in model:
        return True
    return model["layers"] % (spec.model_stages(pp) * (vpp or 1)) == 0


def tp_fits(launch: Launch, tp: int) -> bool:
    """Whether Megatron splits the model's heads, query groups and MLP over ``tp`` GPUs of one node."""
    model = launch.model
    groups = model.get("groups") if model.get("gqa") else None
    return (launch.per_node % tp == 0 and model.get("heads", tp) % tp == 0 and model.get("ffn", tp) % tp == 0
            and (groups is None or groups % tp == 0 or tp % groups == 0))


def fitting_sizes(launch: Launch) -> List[Tuple[int, int, int]]:
    """(PP, TP, EP) that run on the GPUs given, the closest to the given sizes first."""
    world = launch.world
    if world > SIZES_WORLD_LIMIT:
        return []
    experts = launch.model.get("experts")
    found = [(pp, tp, ep) for pp in ([launch.pp] if launch.model.get("uneven") else _divisors(world))
             if pp_fits(launch, pp) for tp in _divisors(launch.per_node) if tp_fits(launch, tp)
             for ep in (_divisors(experts) if experts else [1]) if world % launch.unit(pp, tp, ep) == 0]
    given = (launch.pp, launch.tp, launch.ep)

    def distance(c: Tuple[int, int, int]) -> tuple:
        pp, tp, ep = c  # the products: of the dense layers' sizes, of the experts' (CP and ETP as given)
        gap = abs(math.log2(pp * tp / (launch.pp * launch.tp))) + \
            abs(math.log2(pp * (launch.etp or tp) * ep / (launch.pp * (launch.etp or launch.tp) * launch.ep)))
        moved = sum(abs(math.log2(new / old)) for new, old in zip(c, given))
        changed = sum(new != old for new, old in zip(c, given))
        return bool(batch_fix(launch, world, pp, tp)), round(gap, 9), changed, round(moved, 9), -pp

    return sorted(found, key=distance)


def sizes_text(launch: Launch) -> str:
    """PP, TP (and EP) for the GPUs given, each with a GLOBAL_BATCH that splits; or "change ..."."""
    options = fitting_sizes(launch)[:SIZES_NAMED]
    if not options:
        return f"or change PP, TP, EP, CP, ETP (no PP, TP, EP fits {launch.world} GPUs with CP={launch.cp})"
    named = [f"PP={pp} TP={tp}{f' EP={ep}' if 'experts' in launch.model else ''}"
             f"{batch_fix(launch, launch.world, pp, tp)}" for pp, tp, ep in options]
    return f"or keep {launch.world} GPUs with {' or '.join(named)}"


# The GPU count

def valid_counts(launch: Launch) -> str:
    """The GPU counts to use instead: the nearest on whole nodes, and NNODES nodes with fewer GPUs each
    where that works; each with a GLOBAL_BATCH that passes there."""
    world, nodes, per_node, unit = launch.world, launch.nodes, launch.per_node, launch.unit()
    step = math.lcm(unit, per_node)  # a multiple of the unit on whole nodes
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
            f"i.e. of {unit}: {valid_counts(launch)}, {sizes_text(launch)}")


def experts_problem(launch: Launch) -> Optional[str]:
    """Why Megatron would refuse EP for the model's experts, or None."""
    experts = launch.model.get("experts")
    if experts is None or experts % launch.ep == 0:
        return None
    return f"EP={launch.ep} does not divide the config's {experts} experts: use an EP that divides {experts}"


# Command line

def parse(argv: Sequence[str]) -> Launch:
    """The launch script's call: its variables as options, then ``--`` and pretrain_gpt.py's arguments."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m megatron_dualpipe.launch.sizes")
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

"""What the commands share: a command, the one-line user error, the cost and communication arguments, output files,
the patch tables. Imported from here, never from the package's ``__init__`` (which imports every command)."""
from __future__ import annotations

import argparse
import math
import os
import textwrap
from dataclasses import dataclass
from typing import Callable, Optional

from ..schedule.copy_sum import WAYS


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


@dataclass(frozen=True)
class Command:
    """One subcommand: each command module exports its own as ``COMMAND``; ``run`` returns the exit status."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_cost_args(p: argparse.ArgumentParser, title: str, defaults: bool = True) -> None:
    """--f --b --w --fb --p2p: the simulator's ``Costs``; without ``defaults`` None where not given."""
    g = p.add_argument_group(title)
    for flag, default, text in (("--f", 1.0, "forward"), ("--b", 2.0, "full backward, input + weight grads"),
                                ("--w", 1.0, "weight-grad part of the backward")):
        g.add_argument(flag, type=float, default=default if defaults else None,
                       help=text + (f" (default {default:g})" if defaults else ""))
    g.add_argument("--fb", type=float, default=None, help="fused F&B unit (default f+b)")
    g.add_argument("--p2p", type=float, default=0.0, help="latency of a send between ranks (default 0)")


def fused_cost_problem(f: float, b: float, w: float, fb) -> Optional[str]:
    """Why ``fb`` cannot be a fused F&B unit's cost, or None: it runs a forward and an input backward
    (``b - w``) together, so it costs at least the larger of the two."""
    least = max(f, b - w)
    if fb is None or not fb < least:
        return None
    part = f"--f {f:g}" if f >= b - w else f"the input backward --b - --w = {b - w:g}"
    return (f"--fb {fb:g} is cheaper than {part} alone: a fused F&B unit runs a forward and a backward "
            f"together, so --fb must be at least {least:g} (--f + --b = {f + b:g} is the cost without overlap)")


def costs_from_args(args):
    from ..schedule.simulate import Costs

    costs = Costs(f=args.f, b=args.b, w=args.w, fb=args.fb, p2p=args.p2p)  # checks its values
    if problem := fused_cost_problem(costs.f, costs.b, costs.w, costs.fb):
        raise CliError(problem)
    return costs


def add_comm_args(p: argparse.ArgumentParser) -> None:
    """The gradient communication and P2P links (``costs.comm_cost``); costs are then ms."""
    g = p.add_argument_group("communication (with --stage-params or --message-bytes: costs are in ms; "
                             "the iteration is the makespan plus the exposed gradient communication)")
    g.add_argument("--stage-params", type=float, default=None, metavar="N",
                   help="parameters of one pipeline stage on one rank (after tensor parallel)")
    g.add_argument("--grad-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="gradient dtype of the reductions (default fp32, Megatron's main grads)")
    g.add_argument("--message-bytes", type=float, default=None, metavar="BYTES",
                   help="one P2P message: a micro-batch's activation (or its gradient) between stages")
    g.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size, for the rank placement (default 1)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default 8)")
    g.add_argument("--placement", choices=("megatron", "paired"), default="megatron",
                   help="megatron: Megatron's rank order (tp, dp, pp) on nodes of consecutive ranks; paired: what "
                        "the launcher's --pair-placement (PAIR_PLACEMENT=1) does for dualpipe, pipeline ranks i and "
                        "pp-1-i on one node (other schedules stay in Megatron's placement)")
    g.add_argument("--intra-bw", type=float, default=200.0, metavar="GB/s",
                   help="bandwidth per rank inside a node (default 200)")
    g.add_argument("--inter-bw", type=float, default=25.0, metavar="GB/s",
                   help="bandwidth per rank between nodes (default 25)")
    g.add_argument("--intra-latency", type=float, default=0.01, metavar="MS", help="default 0.01")
    g.add_argument("--inter-latency", type=float, default=0.02, metavar="MS", help="default 0.02")
    g.add_argument("--distributed-optimizer", action="store_true",
                   help="the data-parallel reduction is a reduce-scatter (Megatron's distributed optimizer)")
    g.add_argument("--bd-reduction", choices=[w.value for w in WAYS], default=WAYS[0].value,
                   help="how DualPipe's two copies of a stage meet data parallel: bd-first (what the executor does), "
                        "dp-first (training's --dualpipe-dp-first: reduce-scatter over dp, then the pair sums the 1/dp shards after the "
                        "schedule; needs --distributed-optimizer to carry less), or shared-shard (one reduce-scatter over 2 x dp; needs "
                        "--distributed-optimizer; training's --dualpipe-shared-shard-group, which reduces after the "
                        "schedule: model it with --no-overlap-grad-reduce)")
    g.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                   help="Megatron's own schedules reduce after the pipeline (no --overlap-grad-reduce)")


def comm_from_args(args, pp: int):
    """The ``CommModel`` of ``args``, or None when neither gradients nor messages were given."""
    from ..costs.comm_cost import DTYPE_BYTES, CommModel, Link, Network, Placement

    if args.stage_params is None and args.message_bytes is None:
        return None
    for flag, v in (("--stage-params", args.stage_params), ("--message-bytes", args.message_bytes)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise CliError(f"{flag} must be a finite number >= 0, got {v}")
    for flag, v in (("--dp", args.dp), ("--tp", args.tp), ("--gpus-per-node", args.gpus_per_node)):
        if v < 1:
            raise CliError(f"{flag} must be a positive integer, got {v}")
    try:
        network = Network(Link(args.intra_bw, args.intra_latency), Link(args.inter_bw, args.inter_latency))
    except ValueError as e:
        raise CliError(f"--intra-bw/--inter-bw/--intra-latency/--inter-latency: {e}") from None
    try:
        placement = Placement(pp, args.dp, args.tp, args.gpus_per_node, args.placement == "paired")
    except ValueError as e:
        raise CliError(f"--placement {args.placement}: {e}") from None
    try:
        return CommModel(placement, network,
                         (args.stage_params or 0.0) * DTYPE_BYTES[args.grad_dtype], args.message_bytes or 0.0,
                         args.distributed_optimizer, args.overlap_grad_reduce, bd_mode=args.bd_reduction)
    except ValueError as e:  # a way that needs the distributed optimizer
        raise CliError(f"--bd-reduction {args.bd_reduction}: {e}: add --distributed-optimizer") from None


def png_path(text: str) -> str:
    """``--png FILE``'s type: a name that says other than PNG (``x.jpg``) is refused, not written with PNG bytes."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--png needs a file name, got an empty one")
    ext = os.path.splitext(text)[1].lower()
    if ext != ".png":
        stem = os.path.splitext(text)[0] if ext else text
        raise argparse.ArgumentTypeError(f"{text!r}: the picture is written as PNG: name it {stem or 'timeline'}.png")
    return text


def check_writable(path: str) -> None:
    """Fail before the work if ``path`` cannot be created (without leaving a file behind)."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"cannot write {path}: is a directory")
    if not os.path.isdir(d):
        raise CliError(f"cannot write {path}: directory {d} does not exist")
    if not os.access(d, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CliError(f"cannot write {path}: permission denied")


def snapshot(patches) -> dict:
    """target -> (owner, name, object) of each patch for this megatron-core: what an undo must give back."""
    from ..hooks.mechanism import current, megatron_core_version, resolve

    version, found = megatron_core_version(), {}
    for patch in patches:
        if version in patch.versions:
            owner, name = resolve(patch)
            found[patch.target] = (owner, name, current(owner, name))
    return found


def not_restored(saved: dict) -> list:
    """The targets of :func:`snapshot` that do not hold their object again."""
    from ..hooks.mechanism import current

    return [target for target, (owner, name, obj) in saved.items() if current(owner, name) is not obj]


def print_by_part(rows, noun: str, describe, restored, undo: str) -> None:
    """``hooks`` / ``cpu-mode``'s table by part (``describe(patch, state)``: line, why), then the undo's verdict."""
    part = None
    for p, patch, state in rows:
        if p != part:
            part = p
            print(f"\n{p}: {sum(1 for q, _, _ in rows if q == p)} {noun}")
        line, why = describe(patch, state)
        print(line)
        print(textwrap.fill(why, width=100, initial_indent=" " * 13, subsequent_indent=" " * 13))
    if restored is not None:
        verdict = "every patched attribute is back" if not restored else f"NOT restored: {', '.join(restored)}"
        print(f"\n{undo}(): {verdict}")

"""The gradient communication and P2P link arguments of ``simulate`` and ``advise``."""
from __future__ import annotations

import argparse
import math

from ..schedule.copy_sum import WAYS
from .args import CliError


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
    """The :class:`~.costs.comm_cost.CommModel` of ``args``, or None when neither gradients nor
    messages were given (then P2P costs ``--p2p`` and gradients nothing)."""
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

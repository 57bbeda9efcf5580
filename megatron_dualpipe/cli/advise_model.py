"""``advise`` from the model's shape: a config of ``configs/`` and/or ``pretrain_gpt.py``'s
arguments, a GPU kind and the node layout -> the stage costs and memory that
:func:`megatron_dualpipe.costs.advice.advise` simulates (:mod:`..costs.model_cost`)."""
from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass
from typing import List

from .. import project_files
from ..costs import model_cost as mc
from ..costs import stage_pairs
from ..costs.comm_cost import CommModel, Link, Network, Placement
from ..costs.compare import fmt
from ..costs.model_args import parse
from ..schedule import registry, stage_layout
from ..schedule.copy_sum import WAYS, CopySum
from ..schedule.simulate import Costs
from .args import CliError

CONFIGS = project_files.path("configs")  # the wheel's copy, else the checkout's
#: The launch script's variables a config sets, and the pretrain_gpt.py flag each becomes.
CONFIG_VARIABLES = (("TP", "--tensor-model-parallel-size"), ("PP", "--pipeline-model-parallel-size"),
                    ("EP", "--expert-model-parallel-size"), ("CP", "--context-parallel-size"),
                    ("ETP", "--expert-tensor-parallel-size"), ("MICRO_BATCH", "--micro-batch-size"),
                    ("GLOBAL_BATCH", "--global-batch-size"), ("SCHEDULE", "--pipeline-schedule"),
                    ("VOCAB_SIZE", "--vocab-size"))


def configure(p) -> None:
    g = p.add_argument_group("from the model instead of measured costs (pretrain_gpt.py's arguments after --)")
    g.add_argument("--config", metavar="NAME", help="a config of configs/ (" + ", ".join(config_names())
                   + ") or a path; arguments after -- are appended, as the launch script appends them")
    g.add_argument("--gpu", choices=sorted(mc.GPUS), help="GPU kind: its peak dense bf16 rate, HBM (the memory limit "
                   "unless --memory-limit), NVLink and network bandwidth")
    g.add_argument("--nodes", type=int, default=None, metavar="N", help="nodes (default 1); GPUs per node: "
                   "--gpus-per-node")
    g.add_argument("--mfu", type=float, default=None, metavar="U",
                   help=f"share of the peak rate training sustains (default {mc.DEFAULT_MFU})")
    p.add_argument("model_args", nargs="*", metavar="-- ARGS", help="pretrain_gpt.py arguments (after --)")


def config_names() -> List[str]:
    try:
        return sorted(f[:-3] for f in os.listdir(CONFIGS) if f.endswith(".sh"))
    except OSError:
        return []


def config_argv(name: str, nodes: int = 1, gpus_per_node: int = 8) -> List[str]:
    """The pretrain_gpt.py arguments the launch script builds from config ``name`` on ``nodes`` x
    ``gpus_per_node`` GPUs (its MODEL_ARGS and parallel sizes, the config's defaults: PP, TP, ...
    of this environment are not read; a config may size them by NNODES and GPUS_PER_NODE)."""
    path = name if os.path.isfile(name) else os.path.join(CONFIGS, f"{name[:-3] if name.endswith('.sh') else name}.sh")
    if not os.path.isfile(path):
        raise CliError(f"--config {name}: no such config; use one of {', '.join(config_names())} or a path")
    names = [v for v, _ in CONFIG_VARIABLES]
    script = ('set -eu; source "$1"; printf "%s\\n" "${MODEL_ARGS[@]}"; echo @@; '
              + "; ".join(f'echo "${{{v}:-}}"' for v in names))
    env = {k: v for k, v in os.environ.items() if k not in names}
    env.update(NNODES=str(nodes), GPUS_PER_NODE=str(gpus_per_node))
    proc = subprocess.run(["bash", "-c", script, "config", path], env=env, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0 or "@@" not in proc.stdout.splitlines():
        raise CliError(f"--config {name}: {path} does not define MODEL_ARGS ({proc.stderr.strip()[:200]})")
    lines = proc.stdout.splitlines()
    cut = lines.index("@@")
    given = [(flag, value) for (_, flag), value in zip(CONFIG_VARIABLES, lines[cut + 1:]) if value]
    return lines[:cut] + [x for pair in given for x in pair]


@dataclass(frozen=True)
class Setup:
    """What advise needs from a model: the layout, the stage's costs and memory, the comm model."""

    model: object
    gpu: object
    dp: int
    microbatches: int
    costs: object
    memory: object
    lines: List[str]


def _layout(m, world: int):
    """(dp, micro-batches per iteration) of ``m`` on ``world`` GPUs, or the refusal with the fix."""
    if problem := mc.stages_problem(m):
        raise CliError(problem)
    unit = m.model_size * (m.etp * m.ep * m.pp) // math.gcd(m.model_size, m.etp * m.ep * m.pp)
    if world % unit:
        raise CliError(f"{world} GPUs: Megatron needs a multiple of TP*PP*CP={m.model_size} and of "
                       f"ETP*EP*PP={m.etp * m.ep * m.pp}, i.e. of {unit}: change --nodes/--gpus-per-node or the "
                       f"parallel sizes")
    dp = world // m.model_size
    gb = m.global_batch or m.micro_batch * dp
    if gb % (m.micro_batch * dp):
        raise CliError(f"--global-batch-size {gb} is not a multiple of --micro-batch-size {m.micro_batch} x "
                       f"data-parallel size {dp}: use a multiple of {m.micro_batch * dp}")
    return dp, gb // (m.micro_batch * dp)


def setup(args) -> Setup:
    """The model of ``args`` (``--config`` and the arguments after ``--``) on ``--gpu`` x world."""
    if not args.gpu:
        raise CliError("advise from the model needs --gpu (" + ", ".join(sorted(mc.GPUS)) + ")")
    nodes = 1 if args.nodes is None else args.nodes
    mfu = mc.DEFAULT_MFU if args.mfu is None else args.mfu
    if nodes < 1 or args.gpus_per_node < 1:
        raise CliError("--nodes and --gpus-per-node must be positive integers")
    if not (0 < mfu <= 1):
        raise CliError(f"--mfu must be in (0, 1], got {mfu}: the share of the peak rate, e.g. 0.4")
    argv = ((config_argv(args.config, nodes, args.gpus_per_node) if args.config else [])
            + [a for a in args.model_args if a != "--"])
    m = parse(argv)  # a ModelArgsError is a ValueError: main prints it as one line
    gpu, world = mc.GPUS[args.gpu], nodes * args.gpus_per_node
    dp, micro = _layout(m, world)
    a2a_bw = args.inter_bw if m.etp * m.ep > args.gpus_per_node else args.intra_bw
    sc = mc.heaviest_stage(m, gpu, mfu, args.gpus_per_node, a2a_bw)
    mem = mc.heaviest_memory(m, world)
    costs = Costs(f=sc.f, b=sc.b, w=sc.w, fb=sc.fb)
    lines = _summary(m, gpu, mfu, nodes, args.gpus_per_node, dp, micro, sc, mem)
    every = [mc.stage_costs(m, gpu, mfu, args.gpus_per_node, i, a2a_bw) for i in range(m.pp)]
    if len({round(c.f + c.b, 9) for c in every}) > 1:  # uneven stages: the simulator takes the slowest's
        lines.insert(4, "  every stage's f/b/w (ms): " + ", ".join(f"{c.f:.3g}/{c.b:.3g}/{c.w:.3g}" for c in every))
        # which stages each rank holds under 1F1B, DualPipe and DualPipeV, and their summed forward time
        forward = [mc.partition_f(m, gpu, mfu, args.gpus_per_node, sizes, a2a_bw)
                   for sizes in (mc.stage_sizes(m), mc.v_stage_sizes(m))]
        lines += stage_pairs.report(*forward, (registry.ONE_F_ONE_B, registry.DUALPIPE, registry.DUALPIPEV),
                                    unit=" (forward ms per micro-batch)")
        ends = m.first_stage_layers is not None or m.last_stage_layers is not None
        if ends or (m.layout is not None and len(stage_layout.parse(m.layout)) == m.pp):  # dualpipev: 2pp V-stages
            v = stage_layout.to_text(stage_layout.halved(stage_layout.from_sizes(mc.stage_sizes(m))))
            lines.append(f"  dualpipev runs these V-stages as --pipeline-model-parallel-layout '{v}' (it refuses "
                         f"--decoder-first/last-pipeline-num-layers and a layout of {m.pp} stages)")
    return Setup(m, gpu, dp, micro, costs, mem, lines)


def _summary(m, gpu, mfu, nodes, per_node, dp, micro, sc, mem) -> List[str]:
    gb = micro * m.micro_batch * dp
    flops = mc.iteration_flops(m, gb)
    a2a = f", of which MoE all-to-all {sc.all_to_all:.3g} ms each way" if sc.all_to_all else ""
    return [
        "model: " + ", ".join(mc.describe(m)),
        f"layout: {nodes} x {per_node} {gpu.name} (peak {gpu.peak_tflops:g} TFLOP/s bf16 dense, {gpu.hbm_gb:g} GB), "
        f"TP={m.tp} PP={m.pp} EP={m.ep} CP={m.cp} DP={dp}, global batch {gb} = {micro} micro-batches of "
        f"{m.micro_batch} x {m.seq_length} tokens",
        f"FLOPs: {flops:.4g} per iteration (Megatron-LM's count); at {mfu:g} of peak "
        f"{flops / (nodes * per_node * gpu.peak_tflops * 1e12 * mfu):.3g} s of compute per iteration",
        f"stage {sc.stage} (the slowest) per micro-batch: f {sc.f:.3g} ms, b {sc.b:.3g} ms, w {sc.w:.3g} ms"
        + (f", fused F&B {sc.fb:.3g} ms" if sc.fb else "") + a2a,
        f"memory per rank (stage {mem.stage}, GB): parameters {mem.parameters / mc.GB:.3g}, gradients "
        f"{mem.gradients / mc.GB:.3g}, optimizer {mem.optimizer / mc.GB:.3g}"
        f"{' (distributed over DP)' if m.distributed_optimizer else ''}; activations "
        f"{mc.activation_bytes(m) / mc.GB:.3g} per micro-batch on the first stage"
        + ("" if m.recompute else " (no recomputation)"),
    ]


def comm(args, s: Setup):
    """The communication model of the run: gradients of the heaviest stage, P2P messages of one
    micro-batch, the model's DP/TP and optimizer flags, the GPU's links (unless given)."""
    m = s.model
    per_rank = s.memory.parameters / 2  # bf16 parameters -> count
    message = m.micro_batch * m.seq_length * m.hidden * 2 / m.cp / (m.tp if m.sequence_parallel else 1)
    intra = args.intra_bw if args.intra_bw is not None else s.gpu.nvlink_gbps
    inter = args.inter_bw if args.inter_bw is not None else s.gpu.network_gbps
    try:
        network = Network(Link(intra, args.intra_latency), Link(inter, args.inter_latency))
    except ValueError as e:
        raise CliError(f"--intra-bw/--inter-bw/--intra-latency/--inter-latency: {e}") from None
    try:
        placement = Placement(m.pp, s.dp, m.tp, args.gpus_per_node, args.placement == "paired")
    except ValueError as e:
        raise CliError(f"--placement {args.placement}: {e}") from None
    mode = CopySum.chosen_by(m.flag_set, args.bd_reduction)
    return CommModel(placement, network, per_rank * 4, message, m.distributed_optimizer, m.overlap_grad_reduce,
                     bd_mode=mode)


def no_fit_hint(m, limit: float) -> str:
    """What the user can still change when no schedule fits ``limit``: only what this run does not
    already do."""
    out = []
    if m.recompute != "full":
        more = [x for x in ("layernorm", "mla_up_proj" if m.mla else "", "moe_act" if m.num_experts else "",
                            "moe" if m.num_experts else "mlp") if x and x not in m.recompute_modules]
        if more:
            out.append("--recompute-granularity selective --recompute-modules "
                       + " ".join(sorted(set(m.recompute_modules) | set(more))))
        out.append("--recompute-granularity full (not with --overlap-moe-expert-parallel-comm)")
    if not m.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    else:
        smaller = [way for way in WAYS if way.shards_over_both_copies and not m.flag_set(way.flag)]
        out += [f"{way.flag} (dualpipe keeps one optimizer state for both copies)" for way in smaller]
    if m.micro_batch > 1:
        out.append(f"--micro-batch-size {m.micro_batch // 2}")
    out.append("more GPUs per model copy (a larger PP or EP)")
    return f"try {'; or '.join(out)}"


def overlap_line(m, now, with_overlap) -> str:
    """What ``--overlap-moe-expert-parallel-comm`` (off in this run) would buy: DualPipe's fused F&B
    units and Megatron's interleaved 1F1B both hide the expert all-to-all with it."""
    a, b = (next((o for o in advice.choices[0].options if o.row.name == advice.choices[0].best), None)
            for advice in (now, with_overlap))
    head = "the all-to-all overlap (--overlap-moe-expert-parallel-comm, off in this run, so not assumed): "
    if m.recompute == "full" or "moe" in m.recompute_modules:
        return head + ("not with --recompute-granularity full" if m.recompute == "full" else
                       "not with --recompute-modules moe") + " (refused together: drop it first)"
    if b is None:
        return head + "with it still nothing fits"
    inter = next((o for o in with_overlap.choices[0].options if o.row.name.startswith(registry.INTERLEAVED_1F1B_A2A)
                  and not o.row.problem), None)
    gain = (f", {100 * (a.row.iteration - b.row.iteration) / a.row.iteration:.1f}% shorter than {a.row.name} "
            f"without it ({fmt(a.row.iteration)})" if a is not None else "")
    other = (f"; Megatron's interleaved 1F1B with it: {fmt(inter.row.iteration)}"
             f"{'' if inter.fits else ' (over the memory limit)'}" if inter is not None else "")
    return head + f"with it {b.row.name} would take {fmt(b.row.iteration)}{gain}{other}"

"""Which schedule to use for a model: ``megatron-dualpipe advise`` and :func:`advise`, which simulates every
schedule (``costs.compare``) for each micro-batch count and picks the fastest that fits the memory limit
(:func:`_choose`). Standard library only (the simulator's layer), so it imports in milliseconds."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple

from ..schedule.copy_sum import WAYS, CopySum
from ..schedule.registry import (INTERLEAVED_1F1B, INTERLEAVED_1F1B_A2A, MODELLED_SPECS, ONE_F_ONE_B,
                                 SPECS as SPECS_RUN, distinct_orders)
from ..schedule.registry import spec as get
from ..schedule.simulate import Costs
from .comm_cost import DTYPE_BYTES, PAIRED, CommModel
from .compare import Row, align, compare, fmt, in_other_placement, run

#: Schedules within this fraction of the fastest count as equally fast.
TIE = 0.01
#: What ``advise`` suggests when nothing fits, unless its caller knows the model (``no_fit_hint``).
NO_FIT_HINT = "use a larger pp, recomputation, or a smaller micro-batch"
#: A gain over 1F1B below this fraction, bought with more memory, is called small in the reason.
SMALL_GAIN = 0.05


def run_flags(name: str, pp: int, num_layers: Optional[int] = None) -> str:
    """How to run schedule ``name``: the launch script's SCHEDULE and the pretrain_gpt.py flags.
    Interleaved 1F1B is Megatron's own 1f1b with a virtual pipeline of v chunks per rank."""
    s = get(name)
    if s.name in SPECS_RUN:
        return f"SCHEDULE={s.name} (scripts/pretrain_gpt_dualpipe.sh), i.e. --pipeline-schedule {s.name}"
    base = next(b for b in MODELLED_SPECS if s.name == b or s.name.startswith(b + "-v"))
    per = (str(num_layers // (pp * s.virtual)) if num_layers and num_layers % (pp * s.virtual) == 0 else
           f"(--num-layers / {pp * s.virtual}: {s.virtual} chunks per rank)")
    a2a = " --overlap-moe-expert-parallel-comm" if base == INTERLEAVED_1F1B_A2A else ""
    return (f"SCHEDULE={ONE_F_ONE_B} with --num-layers-per-virtual-pipeline-stage {per}{a2a} appended, i.e. Megatron's "
            f"own --pipeline-schedule {ONE_F_ONE_B} with a virtual pipeline of {s.virtual}")


@dataclass(frozen=True)
class Option:
    """One schedule at one micro-batch count, with its memory."""

    row: Row
    activation_memory: float = 0.0
    weight_grad_memory: float = 0.0
    parameter_memory: float = 0.0
    fits: bool = True

    @property
    def memory(self) -> float:
        return self.activation_memory + self.weight_grad_memory + self.parameter_memory

    def to_json(self) -> dict:
        d = self.row.to_json()
        if not self.row.problem:
            d.update(activation_memory=self.activation_memory, weight_grad_memory=self.weight_grad_memory,
                     parameter_memory=self.parameter_memory, memory=self.memory, fits=self.fits)
        return d


@dataclass(frozen=True)
class BreakEven:
    """Where the pick stops being ahead of ``rival``: the inter-node bandwidth (GB/s) and the
    micro-batch size (as a factor of the given one, and in tokens when they were given). None:
    no crossing within a factor of 1000 either way."""

    rival: str
    bandwidth: Optional[float] = None
    bandwidth_now: Optional[float] = None
    scale: Optional[float] = None
    tokens: Optional[float] = None

    def to_json(self) -> dict:
        return {"rival": self.rival, "inter_node_bandwidth": self.bandwidth, "inter_node_bandwidth_now":
                self.bandwidth_now, "microbatch_scale": self.scale, "tokens_per_microbatch": self.tokens}

    def text(self, tokens: Optional[float]) -> str:
        parts = [] if self.bandwidth_now is None else [
            f"at no inter-node bandwidth within 1000x of {fmt(self.bandwidth_now)} GB/s" if self.bandwidth is None else
            f"at {fmt(round(self.bandwidth, 3))} GB/s between nodes (now {fmt(self.bandwidth_now)})"]
        parts.append("at no micro-batch size within 1000x of this one" if self.scale is None else
                     f"at micro-batches {fmt(round(self.scale, 3))} times as large as now" if self.tokens is None else
                     f"at {fmt(round(self.tokens))} tokens per micro-batch (now {fmt(tokens)})")
        return f"break-even with {self.rival}: " + "; ".join(parts)


@dataclass(frozen=True)
class PlacementEffect:
    """What the other rank placement does to a schedule with bd pairs: with the launcher's ``--pair-placement``
    (``paired``) its bd sums stay inside a node; ``problem``: why the pairs cannot be placed so here (then
    ``iteration`` is None). ``fastest``: it would then be the fastest that fits (the others in Megatron's placement)."""

    schedule: str
    placement: str
    now: float
    iteration: Optional[float] = None
    fastest: bool = False
    problem: Optional[str] = None
    fits: bool = True

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "placement": self.placement, "iteration_now": self.now,
                "iteration": self.iteration, "fastest": self.fastest, "problem": self.problem, "fits": self.fits}

    def text(self) -> str:
        how = ("with pipeline ranks i and pp-1-i on one node (launcher --pair-placement, PAIR_PLACEMENT=1)"
               if self.placement == PAIRED else "in Megatron's own rank placement (advise --placement megatron)")
        if self.problem:  # the launcher's refusal names --pair-placement, which advise's user did not give
            problem = re.sub(r",? or drop --pair-placement", "", self.problem)
            return f"{self.schedule} cannot have pipeline ranks i and pp-1-i on one node here: {problem}"
        return (f"{self.schedule} {how}: iteration {fmt(self.iteration)} instead of {fmt(self.now)} "
                f"({_change(self.iteration, self.now)}), {_standing(self.fastest, self.fits)}")


@dataclass(frozen=True)
class ReductionEffect:
    """A schedule with bd pairs under another way of combining its copies (with the distributed optimizer:
    ``schedule.copy_sum``), as training runs it: the shared shard group reduces after the schedule, dp-first sums the
    pair after it. ``fastest``: it would then be the fastest schedule that fits (the others as modelled)."""

    schedule: str
    mode: str
    now_mode: str
    now: float
    iteration: float
    fastest: bool = False
    fits: bool = True

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "bd_reduction": self.mode, "flag": CopySum(self.mode).flag or "no flag",
                "iteration": self.iteration, "bd_reduction_now": self.now_mode, "iteration_now": self.now,
                "fastest": self.fastest}

    def text(self) -> str:
        way = CopySum(self.mode)
        return (f"{self.schedule} with {way.flag or 'no flag'} ({way.words}{way.memory_words}): iteration "
                f"{fmt(self.iteration)} instead of {fmt(self.now)} ({CopySum(self.now_mode).words}): "
                f"{_change(self.iteration, self.now)}, {_standing(self.fastest, self.fits)}")


def _change(new: float, now: float) -> str:
    if new > now:
        return f"{100 * (new - now) / now:.1f}% longer" if now > 0 else "longer"
    return f"{_pct(new, now)} shorter" if new < now else "the same"


def _standing(fastest: bool, fits: bool) -> str:
    if not fits:
        return "but it does not fit the memory limit"
    return "the fastest that fits" if fastest else "not the fastest that fits"


@dataclass(frozen=True)
class Choice:
    microbatches: int
    options: List[Option]
    best: Optional[str]
    reason: str
    break_even: Optional[BreakEven] = None
    placement: List[PlacementEffect] = field(default_factory=list)
    reduction: List[ReductionEffect] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"microbatches": self.microbatches, "best": self.best, "reason": self.reason,
                "break_even": None if self.break_even is None else self.break_even.to_json(),
                "placement": [p.to_json() for p in self.placement],
                "bd_reduction": [r.to_json() for r in self.reduction],
                "options": [o.to_json() for o in self.options]}


@dataclass(frozen=True)
class Advice:
    pp: int
    costs: Costs
    activation_memory: float
    parameter_memory: float
    weight_grad_memory: float
    memory_limit: Optional[float]
    choices: List[Choice] = field(default_factory=list)
    comm: Optional[CommModel] = None
    tokens: Optional[float] = None
    num_layers: Optional[int] = None

    def to_json(self) -> dict:
        c, m = self.costs, self.comm
        p, n = (m.placement, m.network) if m else (None, None)
        comm = None if m is None else {
            "dp": p.dp, "tp": p.tp, "gpus_per_node": p.gpus_per_node, "placement": p.name,
            "stage_grad_bytes": m.stage_grad_bytes, "message_bytes": m.message_bytes,
            "intra_node": {"bandwidth_gbps": n.intra.bandwidth, "latency_ms": n.intra.latency},
            "inter_node": {"bandwidth_gbps": n.inter.bandwidth, "latency_ms": n.inter.latency},
            "distributed_optimizer": m.distributed_optimizer, "overlap_grad_reduce": m.overlap_grad_reduce}
        return {"pp": self.pp, "stage_costs": {"f": c.f, "b": c.b, "w": c.w, "fb": c.fused, "p2p": c.p2p},
                "communication": comm, "tokens_per_microbatch": self.tokens,
                "activation_memory": self.activation_memory, "parameter_memory": self.parameter_memory,
                "weight_grad_memory": self.weight_grad_memory, "memory_limit": self.memory_limit,
                "choices": [dict(ch.to_json(), run=run_flags(ch.best, self.pp, self.num_layers) if ch.best else None)
                            for ch in self.choices]}

    def format(self) -> str:
        c = self.costs
        out = [f"pp={self.pp}, one stage per micro-batch: f={fmt(c.f)} b={fmt(c.b)} w={fmt(c.w)} fb={fmt(c.fused)} "
               f"p2p={fmt(c.p2p)} (DualPipeV runs chunks of half a stage at half these costs)",
               f"memory: activations {fmt(self.activation_memory)} per micro-batch per stage, parameters "
               f"{fmt(self.parameter_memory)} per stage copy (with gradients and optimizer state)"
               + (f", pending W {fmt(self.weight_grad_memory)} each" if self.weight_grad_memory else
                  " (pending weight gradients not counted: --weight-grad-memory)")
               + ("; no memory limit" if self.memory_limit is None else f"; limit {fmt(self.memory_limit)} per rank")]
        m, comm = self.comm, self.comm is not None
        if comm:
            p = m.placement
            out.append(f"communication (ms): dp={p.dp} tp={p.tp}, {p.gpus_per_node} GPUs per node, "
                       f"{'paired (ranks i and pp-1-i on one node)' if p.paired else 'Megatron'} placement; gradients "
                       f"{fmt(m.stage_grad_bytes / 1e6)} MB per stage, P2P messages {fmt(m.message_bytes / 1e6)} MB; "
                       f"links: {_links_text(m)}; data-parallel "
                       f"{'reduce-scatter' if m.distributed_optimizer else 'all-reduce'}"
                       + ("" if m.overlap_grad_reduce else " after the schedule"))
        head = ("schedule", "M", "makespan", "bubble", "bubble %") + (("exposed", "iteration") if comm else ()) + (
            "peak act.", "act. mem", "params", "param mem", "memory", "fits")
        for ch in self.choices:
            out += ["", f"M={ch.microbatches}: " + (f"use {ch.reason}" if ch.best else ch.reason)]
            if ch.best:
                out.append(f"  run it: {run_flags(ch.best, self.pp, self.num_layers)}")
            out.extend(f"  placement: {p.text()}" for p in ch.placement)
            out.extend(f"  summing the two copies: {r.text()}" for r in ch.reduction)
            table = [head]
            for o in ch.options:
                r = o.row
                if r.problem:
                    table.append((r.name, "cannot run: " + r.problem))
                    continue
                table.append((r.name, str(r.microbatches), fmt(r.makespan), fmt(r.bubble),
                              f"{100 * r.bubble / r.makespan:.1f}" if r.makespan else "0")
                             + ((fmt(round(r.exposed, 3)), fmt(round(r.iteration, 3))) if comm else ())
                             + (fmt(r.peak_activations),
                              fmt(o.activation_memory), fmt(r.parameter_copies), fmt(o.parameter_memory), fmt(o.memory),
                              "yes" if o.fits else "no") + (("<- best",) if r.name == ch.best else ()))
            out.extend("  " + line for line in align(table, left=(0, len(head) - 1)))
        return "\n".join(out + ["", GLOSSARY])


@dataclass(frozen=True)
class DenseModel:
    """A dense transformer's stage costs from its size (2 x parameters x tokens FLOPs forward), for what-if
    advice (the crossover table, the seed's sign flip). ``tflops``: what one GPU sustains (peak x MFU)."""

    params: float
    hidden: int
    tokens: int
    pp: int
    tflops: float
    tp: int = 1
    grad_dtype: str = "fp32"

    @property
    def stage_params(self) -> float:
        return self.params / self.pp / self.tp

    @property
    def costs(self) -> Costs:
        f = 2 * self.stage_params * self.tokens / (self.tflops * 1e12) * 1e3
        return Costs(f=f, b=2 * f, w=f)

    @property
    def stage_grad_bytes(self) -> float:
        return self.stage_params * DTYPE_BYTES[self.grad_dtype]

    @property
    def message_bytes(self) -> float:
        return self.tokens * self.hidden * 2 / self.tp


def advise(pp: int, microbatches: Sequence[int], costs: Costs, activation_memory: float,
           parameter_memory: float, memory_limit: Optional[float] = None, weight_grad_memory: float = 0.0,
           names: Optional[Sequence[str]] = None, comm: Optional[CommModel] = None,
           tokens: Optional[float] = None, num_layers: Optional[int] = None,
           optimizer_memory: Optional[float] = None, once_memory: float = 0.0,
           shared_optimizer: bool = False, no_fit_hint: str = NO_FIT_HINT, details: bool = True) -> Advice:
    """Simulate every schedule (or ``names``) on the model and choose one per micro-batch count.

    ``costs``: one stage's 1F1B costs per micro-batch; ``activation_memory``: one micro-batch's activations on one
    stage; ``parameter_memory``: one stage's parameters, gradients and optimizer state (``optimizer_memory`` of it the
    optimizer state, which ``shared_optimizer``, DualPipe's shared shard group, keeps once); ``weight_grad_memory``:
    one deferred weight gradient until its W (0: not counted); ``once_memory``: activations a rank keeps once whatever
    the schedule (the output logits); ``memory_limit``: per rank, in the memories' unit (None: none). With ``comm``
    (``costs.comm_cost``, costs in ms) schedules are ranked by makespan plus exposed gradient communication and the
    pick gets its break-even bandwidth and micro-batch size (``tokens`` per micro-batch). ``num_layers``: for the
    interleaved schedule's flags in the advice. ``details=False``: only the pick (the launch's memory gate), without
    the break-even and the placement and reduction effects, which simulate each schedule again a hundred times."""
    for name, v in (("activation memory", activation_memory), ("parameter memory", parameter_memory),
                    ("weight-gradient memory", weight_grad_memory), ("memory limit", memory_limit)):
        if v is not None and (not math.isfinite(v) or v < 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v}")
    if not microbatches:
        raise ValueError("give at least one micro-batch count")
    choices = []
    names = list(names or distinct_orders())
    for m in microbatches:
        options = []
        for row in compare(pp, m, costs, names, comm=comm):
            if row.problem:
                options.append(Option(row, fits=False))
                continue
            act = row.peak_activations * activation_memory + once_memory
            wgrad = row.peak_weight_grad_states * weight_grad_memory
            par = row.parameter_copies * parameter_memory
            if shared_optimizer and optimizer_memory:
                par -= (row.parameter_copies - 1) * optimizer_memory
            fits = memory_limit is None or act + wgrad + par <= memory_limit
            options.append(Option(row, act, wgrad, par, fits))
        best, reason = _choose(options, memory_limit, no_fit_hint)
        even, detailed = None, details and comm is not None
        if best is not None and detailed:
            even = _break_even(pp, m, costs, comm, options, best, tokens)
            if even is not None:
                reason += "; " + even.text(tokens)
        effects, reduction = (_effects(pp, m, costs, comm, options, memory_limit, optimizer_memory) if detailed
                              else ([], []))
        choices.append(Choice(m, options, best, reason, even, effects, reduction))
    return Advice(pp, costs, activation_memory, parameter_memory, weight_grad_memory, memory_limit, choices, comm,
                  tokens, num_layers)


def _crossing(diff, now: float) -> Optional[float]:
    """The value nearest ``now`` (within a factor of 1000 either way) where ``diff`` changes sign,
    by doubling away from ``now`` and then bisecting (geometrically); None if it never does."""
    d0 = diff(now)
    for direction in (0.5, 2.0):
        lo, x = now, now
        for _ in range(10):
            x = lo * direction
            if (diff(x) > 0) != (d0 > 0):
                a, b = lo, x
                for _ in range(16):
                    mid = math.sqrt(a * b)
                    if (diff(mid) > 0) == (d0 > 0):
                        a = mid
                    else:
                        b = mid
                return math.sqrt(a * b)
            lo = x
    return None


def _break_even(pp, m, costs, comm, options, best, tokens) -> Optional[BreakEven]:
    """Where ``best`` loses its lead over the next fastest schedule that fits."""
    others = [o for o in options if not o.row.problem and o.fits and o.row.name != best]
    if not others:
        return None
    rival = min(others, key=lambda o: o.row.iteration).row.name

    def lead(c: CommModel, k: float = 1.0) -> float:
        return (run(best, pp, m, costs.scaled(k), comm=c).iteration
                - run(rival, pp, m, costs.scaled(k), comm=c).iteration)

    now = comm.network.inter.bandwidth
    uses_inter = comm.placement.world > comm.placement.gpus_per_node
    bw = _crossing(lambda x: lead(comm.with_inter_bandwidth(x)), now) if uses_inter else None
    scale = _crossing(lambda k: lead(replace(comm, message_bytes=comm.message_bytes * k), k), 1.0)
    return BreakEven(rival, bw, now if uses_inter else None, scale,
                     None if scale is None or tokens is None else scale * tokens)


def _beats_all(t: float, o: Option, options: List[Option]) -> bool:
    """Whether iteration ``t`` of ``o``'s schedule is shorter than every other runnable one that fits."""
    return all(t < x.row.iteration for x in options if not x.row.problem and x.fits and x is not o)


def _effects(pp, m, costs, comm: CommModel, options: List[Option], limit: Optional[float],
             optimizer_memory: Optional[float]) -> Tuple[List[PlacementEffect], List[ReductionEffect]]:
    """Each runnable schedule with bd pairs in the other placement (the launcher pairs only them) and, with the
    distributed optimizer, under the other ways of combining its two copies that training implements: the
    shared shard group keeps one stage's optimizer state instead of two, and with ``optimizer_memory`` (that
    state, part of the parameter memory) its fit is judged on that."""
    placement, reduction, now = [], [], CopySum(comm.bd_mode)
    for o in options:
        if o.row.problem or not get(o.row.name).mirrored:
            continue
        name, row, problem = in_other_placement(o.row.name, pp, m, costs, comm)
        t = None if row is None else row.iteration
        placement.append(PlacementEffect(o.row.name, name, o.row.iteration, t, t is not None and o.fits
                                         and _beats_all(t, o, options), problem, row is None or o.fits))
        for mode in (way for way in WAYS if way is not now and comm.distributed_optimizer):
            # training's shared shard group cannot overlap its reduce-scatters yet (refused with it)
            overlap = comm.overlap_grad_reduce and not mode.shards_over_both_copies
            t = run(o.row.name, pp, m, costs, comm=replace(comm, bd_mode=mode, overlap_grad_reduce=overlap)).iteration
            fits = o.fits
            shared = mode.shards_over_both_copies - now.shards_over_both_copies  # +1: one copy less, -1: one more
            if shared and optimizer_memory is not None:
                memory = o.memory - shared * optimizer_memory * (o.row.parameter_copies - 1)
                fits = limit is None or memory <= limit
            reduction.append(ReductionEffect(o.row.name, mode, comm.bd_mode, o.row.iteration, t,
                                             fits and _beats_all(t, o, options), fits=fits))
    return placement, reduction


def _pct(a: float, b: float) -> str:
    return f"{100 * (b - a) / b:.1f}%" if b > 0 else "0%"


def _choose(options: List[Option], limit: Optional[float], hint: str = NO_FIT_HINT):
    """The fastest schedule that fits (by the model's iteration time: never one it says is
    slower); on an exact tie the one with less memory, then the table's order. The reason names
    schedules within ``TIE`` that need less memory, and faster ones over the limit."""
    runnable = [o for o in options if not o.row.problem]
    if not runnable:
        return None, "no schedule can run: " + "; ".join(o.row.problem for o in options)
    fitting = [o for o in runnable if o.fits]
    if not fitting:
        least = min(runnable, key=lambda o: o.memory)
        return None, (f"no schedule fits the memory limit {fmt(limit)}: the least memory is {least.row.name}'s "
                      f"{fmt(least.memory)}; {hint}")
    order = {n: i for i, n in enumerate(distinct_orders())}
    best = min(fitting, key=lambda o: (o.row.iteration, o.memory, order.get(o.row.name, len(order))))
    r = best.row
    comm = r.grad is not None
    rival = min((o for o in fitting if o is not best), key=lambda o: o.row.iteration, default=None)
    parts = [f"{'iteration' if comm else 'makespan'} {fmt(r.iteration)}"
             + (f" = makespan {fmt(r.makespan)} + exposed gradient communication {fmt(r.exposed)}" if comm else "")
             + f", bubble {fmt(r.bubble)}"]
    base = next((o for o in runnable if o.row.name == ONE_F_ONE_B), None)
    if rival is not None and best is base and rival.row.iteration <= r.iteration * (1 + TIE):
        parts.append(f"nothing that fits is faster ({rival.row.name}: {fmt(rival.row.iteration)}), and "
                     f"{ONE_F_ONE_B} is Megatron's own")
    elif rival is not None:
        parts.append(f"{_pct(r.iteration, rival.row.iteration)} shorter than the best other schedule that fits, "
                     f"{_named(rival.row.name)} ({fmt(rival.row.iteration)})")
    if base is not None and base is not best and base is not rival:
        parts.append(f"{_pct(r.iteration, base.row.iteration)} shorter than Megatron's plain 1F1B "
                     f"({fmt(base.row.iteration)}{'' if base.fits else ', over the memory limit'})")
    memory = (f"peak memory {fmt(best.memory)} = activations {fmt(best.activation_memory)} + parameters, "
              f"gradients and optimizer state {fmt(best.parameter_memory)}"
              + (f" + pending W {fmt(best.weight_grad_memory)}" if best.weight_grad_memory else ""))
    if rival is not None:
        extra = best.memory - rival.memory
        memory += f" ({'+' if extra >= 0 else ''}{fmt(extra)} against {rival.row.name})"
    parts.append(memory)
    if rival is not None and best.memory > rival.memory and r.iteration > rival.row.iteration * (1 - SMALL_GAIN):
        more = 100 * (best.memory - rival.memory) / rival.memory if rival.memory else math.inf
        parts.append(f"a small gain: {_pct(r.iteration, rival.row.iteration)} shorter for {more:.0f}% more memory "
                     f"than {rival.row.name}, which leaves that memory to less recomputation")
    lighter = [o for o in fitting if o is not best and o.row.iteration <= r.iteration * (1 + TIE)
               and o.memory < best.memory]
    if lighter:
        q = min(lighter, key=lambda o: o.memory)
        parts.append(f"{q.row.name} is within {_pct(r.iteration, q.row.iteration)} ({fmt(q.row.iteration)}) and needs "
                     f"{fmt(best.memory - q.memory)} less memory")
    faster = [o for o in runnable if not o.fits and o.row.iteration < r.iteration]
    if faster:
        f = min(faster, key=lambda o: o.row.iteration)
        parts.append(f"{f.row.name} would be {_pct(f.row.iteration, r.iteration)} faster but needs {fmt(f.memory)}, "
                     f"over the limit {fmt(limit)}")
    return best.row.name, f"{best.row.name}: " + "; ".join(parts)


def _named(name: str) -> str:
    """A schedule as a Megatron user knows it."""
    if name.startswith(INTERLEAVED_1F1B_A2A):
        return f"Megatron's interleaved 1F1B with the all-to-all overlap ({name})"
    if name.startswith(INTERLEAVED_1F1B):
        return f"Megatron's interleaved 1F1B ({name})"
    return "Megatron's 1F1B (1f1b)" if name == ONE_F_ONE_B else name


def _links_text(c: CommModel) -> str:
    def one(link) -> str:
        return f"{fmt(round(link.bandwidth, 3))} GB/s + {fmt(round(link.latency, 4))} ms"

    measured = [(w, k) for w, k in (("P2P", c.p2p_link), ("pair sum", c.bd_link), ("data parallel", c.dp_link)) if k]
    if measured:
        return "measured " + ", ".join(f"{w} {one(k)}" for w, k in measured) + (
            f" (others as {one(c.network.inter)})" if len(measured) < 3 else "")
    return f"inside a node {one(c.network.intra)}, between nodes {one(c.network.inter)}"


#: Each printed term once, in Megatron's words.
GLOSSARY = (
    "terms: f, b, w: one micro-batch's forward, backward and the backward's weight-gradient part on one stage; "
    "fb: a fused forward-and-backward unit (DualPipe overlaps one micro-batch's forward with another's backward); "
    "makespan: the pipeline's compute from first forward to last backward; bubble: the busiest rank's idle time in it; "
    "exposed: gradient communication not hidden behind compute (data-parallel reduce-scatter, and DualPipe's sum of "
    "the two copies of a stage held by pipeline ranks i and pp-1-i); iteration: makespan + exposed; peak act.: "
    "micro-batches whose activations one rank holds at once, counted in whole stages; params: stage copies a rank "
    "holds (DualPipe: 2); memory: activations + parameters with their gradients and optimizer state; "
    "break-even: where the pick stops being faster than the runner-up")

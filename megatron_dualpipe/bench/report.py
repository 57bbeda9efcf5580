"""Rank 0's view of a benchmark: the ranks' figures against the simulator, as rows, a table and JSON.

Per schedule, pp and M:

* measured: per iteration the slowest rank's time; median and range over the timed iterations.
* ``x sim``: measured over the simulated makespan with ``p2p=0``; ``x +lat``: with the measured
  one-message latency on every cross-rank dependency; ``x exec``: with that latency and the costs
  as the stages really spent them ("spent": sleeps wake late on a loaded machine), leaving the
  executor's own cost, and noise.
* overhead/action: per rank, (iteration - compute - P2P calls) / actions, the slowest rank's median.
* P2P ms: per rank, time inside the P2P layer's calls, waiting for a peer included.
* peak activations: forwards whose backward has not run, against the simulator's count; "in
  flight": the executor's receive buffers and unfinished sends.
* bd sum (``--grad-mb``): per rank, the time the iteration waited for its bd gradient sums after its
  last action (exposed), and what they take started after the schedule (alone; :mod:`.bd_sum`).
* predicted (``x pred``): from the bench's probes alone, before any schedule runs (docs/benchmarks.md: "pred").
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule import build_schedule
from ..costs.comm_cost import CommModel, Link, Network, Placement, grad_comm
from ..schedule.registry import spec as schedule_spec
from ..schedule.simulate import Costs, simulate
from .measure import BenchConfig, RankRun
from .torch_peer import SIMULATED_PEERS, TORCH_SCHEDULES


@dataclass
class Row:
    runner: str                # "project" or "torch"
    schedule: str
    pp: int
    microbatches: int
    median_ms: float
    min_ms: float
    max_ms: float
    sim_ms: Optional[float] = None        # simulated, p2p = 0
    sim_latency_ms: Optional[float] = None  # simulated, p2p = measured latency
    sim_spent_ms: Optional[float] = None    # simulated, p2p = latency, costs as spent
    overhead_ms_per_action: Optional[float] = None
    spent_over_nominal: Optional[float] = None
    p2p_ms: List[float] = field(default_factory=list)
    peak_activations: List[int] = field(default_factory=list)
    sim_peak_activations: List[int] = field(default_factory=list)
    peak_in_flight: List[Optional[int]] = field(default_factory=list)
    bd_exposed_ms: List[float] = field(default_factory=list)
    bd_alone_ms: List[float] = field(default_factory=list)
    predicted_ms: Optional[float] = None  # from the probes only: makespan with latency + exposed grad comm
    unit_overhead_ms: Optional[float] = None  # probe: the executor's own cost per unit
    bd_probe_ms: Optional[float] = None       # probe: one bd sum of --grad-mb, all pairs at once

    ratio_predicted = property(lambda self: self.median_ms / self.predicted_ms if self.predicted_ms else None)
    ratio = property(lambda self: self.median_ms / self.sim_ms if self.sim_ms else None)
    ratio_latency = property(lambda self: self.median_ms / self.sim_latency_ms if self.sim_latency_ms else None)
    ratio_executor = property(lambda self: self.median_ms / self.sim_spent_ms if self.sim_spent_ms else None)

    def to_json(self) -> dict:
        ratios = ("ratio", "ratio_latency", "ratio_executor", "ratio_predicted")
        return {**asdict(self), **{k: getattr(self, k) for k in ratios}}


def _sim(name: str, pp: int, m: int, costs, p2p: float, scale: float = 1.0):
    s = build_schedule(name, pp, m)
    fb = None if costs.fb is None else costs.fb * scale
    return simulate(s.layout, s.ranks, Costs(f=costs.f * scale, b=costs.b * scale, w=costs.w * scale, fb=fb, p2p=p2p))


def unit_overhead_ms(pp: int, latency: float, probe_iterations: Sequence[Sequence[float]], c) -> float:
    """The cost per unit that makes the simulated probe run (1F1B, pp, M=2pp, the bench's stage costs
    ``c``, ``latency`` per hop) take the probe's time (the slowest rank's, median over iterations)."""
    from ..schedule.registry import EXECUTOR_1F1B

    if not probe_iterations or not probe_iterations[0]:
        return 0.0
    measured = statistics.median(max(r[i] for r in probe_iterations) for i in range(len(probe_iterations[0])))
    s = build_schedule(EXECUTOR_1F1B, pp, 2 * pp)
    probe = Costs(f=c.f, b=c.b, w=c.w, fb=c.fb, p2p=latency)
    base = simulate(s.layout, s.ranks, probe).makespan
    per_unit = simulate(s.layout, s.ranks, probe, overhead=1.0).makespan - base
    return max(0.0, (measured - base) / per_unit) if per_unit > 0 else 0.0


def predicted_ms(name: str, pp: int, m: int, costs, latency: float, grad_mb: float,
                 probe: Optional[float], overhead: float = 0.0) -> float:
    """The prediction from the probes alone (module docstring): the bench's pipeline is one node,
    dp=1; the bd link's bandwidth is what makes one 2-rank sum of ``grad_mb`` take ``probe`` ms
    (every chunk of the bench holds ``grad_mb``: the stage fraction is the chunk's, 1)."""
    s = build_schedule(name, pp, m)
    sim = simulate(s.layout, s.ranks, Costs(f=costs.f, b=costs.b, w=costs.w, fb=costs.fb, p2p=latency),
                   overhead=overhead)
    nbytes = grad_mb * (1 << 20)
    if not probe or nbytes <= 0:
        return sim.makespan
    link = Link(nbytes / (probe / 1e3) / 1e9)  # a 2-rank ring all-reduce moves the bytes once
    comm = CommModel(Placement(pp, 1, 1, gpus_per_node=pp), Network(link, link), stage_grad_bytes=nbytes)
    return grad_comm(s, sim, comm, 1.0, schedule_spec(name).defers_weight_grads).iteration


def rows(cfg: BenchConfig, pp: int, ranks: Sequence[dict]) -> Tuple[Optional[float], List[Row]]:
    """Combine the per-rank results of one pipeline size into rows (and the latency in ms)."""
    latency = ranks[0]["latency_ms"]
    overhead = unit_overhead_ms(pp, latency or 0.0, [r.get("overhead_probe_ms") or [] for r in ranks], cfg.costs)
    out: List[Row] = []
    for key in ranks[0]["runs"]:
        runner, name, m = key
        runs: List[RankRun] = [r["runs"][key] for r in ranks]
        iters = [max(r.wall_s[i] for r in runs) * 1e3 for i in range(len(runs[0].wall_s))]
        row = Row(runner, name, pp, m, statistics.median(iters), min(iters), max(iters))
        row.unit_overhead_ms = overhead
        row.bd_probe_ms = max((r.get("bd_probe_ms") or 0.0) for r in ranks) or None
        sim_name = name if runner == "project" else TORCH_SCHEDULES[name][1]
        if runner == "project" or name in SIMULATED_PEERS:
            row.predicted_ms = predicted_ms(sim_name, pp, m, cfg.costs, latency or 0.0,
                                            cfg.grad_mb if runner == "project" else 0.0, row.bd_probe_ms, overhead)
            sim0 = _sim(sim_name, pp, m, cfg.costs, 0.0)
            row.sim_ms = sim0.makespan
            row.sim_latency_ms = _sim(sim_name, pp, m, cfg.costs, latency or 0.0).makespan
            row.sim_peak_activations = list(sim0.peak_activations)
            row.spent_over_nominal = max(statistics.median(r.compute_s) * 1e3 / busy
                                         for r, busy in zip(runs, sim0.busy) if busy > 0)
            row.sim_spent_ms = _sim(sim_name, pp, m, cfg.costs, latency or 0.0, row.spent_over_nominal).makespan
        if runner == "project":
            row.p2p_ms = [statistics.median(r.p2p_s) * 1e3 for r in runs]
            row.overhead_ms_per_action = max(  # the exposed bd sums are reported apart
                statistics.median((w - c - p - s) / max(r.actions, 1) for w, c, p, s in
                                  zip(r.wall_s, r.compute_s, r.p2p_s, r.bd_exposed_s or [0.0] * len(r.wall_s)))
                for r in runs) * 1e3
            row.peak_activations = [r.peak_live for r in runs]
            row.peak_in_flight = [r.peak_in_flight for r in runs]
            if all(r.bd_exposed_s for r in runs):
                row.bd_exposed_ms = [statistics.median(r.bd_exposed_s) * 1e3 for r in runs]
                row.bd_alone_ms = [r.bd_alone_s * 1e3 for r in runs]
        out.append(row)
    return latency, out


def peer_ratios(all_rows: Sequence[Row]) -> List[Tuple[int, int, str, str, float]]:
    """(pp, M, project schedule, torch schedule, project/torch) for every measured pair."""
    project = {(r.pp, r.microbatches, r.schedule): r for r in all_rows if r.runner == "project"}
    pairs = [(r, project.get((r.pp, r.microbatches, TORCH_SCHEDULES[r.schedule][1])))
             for r in all_rows if r.runner == "torch"]
    return [(r.pp, r.microbatches, mine.schedule, r.schedule, mine.median_ms / r.median_ms)
            for r, mine in pairs if mine is not None]


def _f(x: Optional[float], spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _per_rank(values: Sequence, spec: str = "") -> str:
    return " ".join("-" if v is None else format(v, spec) for v in values) or "-"


def table(cfg: BenchConfig, latencies: Dict[int, Optional[float]], all_rows: Sequence[Row], env: dict) -> str:
    c = cfg.costs
    lines = [f"costs per stage: f={c.f:g} b={c.b:g} (of which w={c.w:g}) fb={'f+b' if c.fb is None else f'{c.fb:g}'} ms; "
             f"compute={cfg.mode}; {cfg.iters} timed iterations after {cfg.warmup} warm-up; tensors "
             f"{cfg.shape[0]}x{cfg.shape[1]} float32; {env.get('backend')} on {env.get('device')}"]
    for pp in sorted({r.pp for r in all_rows}):
        first = next(r for r in all_rows if r.pp == pp)
        lines += ["", f"pp={pp}: one P2P message (rank 0 <-> 1, half a round trip) {_f(latencies.get(pp), '.2f')} ms; "
                  f"the executor's own cost per unit (probe) {_f(first.unit_overhead_ms, '.2f')} ms"
                  + (f"; one bd sum of {cfg.grad_mb:g} MiB, all pairs at once, {_f(first.bd_probe_ms, '.1f')} ms"
                     if first.bd_probe_ms else ""),
                  f"{'runner':<8} {'schedule':<16} {'M':>3} {'measured ms':>11} {'(min-max)':>13} {'sim ms':>7} "
                  f"{'x sim':>6} {'x +lat':>6} {'pred':>7} {'x pred':>6} {'spent':>5} {'x exec':>6} {'ovh/act':>7}  "
                  f"{'P2P ms per rank':<22} {'peak act per rank (sim)':<26} in flight"]
        lines += [f"{r.runner:<8} {r.schedule:<16} {r.microbatches:>3} {r.median_ms:>11.1f} "
                  f"{'(' + f'{r.min_ms:.0f}-{r.max_ms:.0f}' + ')':>13} {_f(r.sim_ms):>7} {_f(r.ratio, '.3f'):>6} "
                  f"{_f(r.ratio_latency, '.3f'):>6} {_f(r.predicted_ms):>7} {_f(r.ratio_predicted, '.3f'):>6} "
                  f"{_f(r.spent_over_nominal, '.3f'):>5} {_f(r.ratio_executor, '.3f'):>6} "
                  f"{_f(r.overhead_ms_per_action, '.2f'):>7}  {_per_rank(r.p2p_ms, '.0f'):<22} "
                  f"{_per_rank(r.peak_activations) + ' (' + _per_rank(r.sim_peak_activations) + ')':<26} "
                  f"{_per_rank(r.peak_in_flight)}" for r in all_rows if r.pp == pp]
    summed = [r for r in all_rows if r.bd_exposed_ms]
    if summed:
        lines += ["", f"bd gradient sums, {cfg.grad_mb:g} MiB per chunk, per rank: exposed after the last action "
                  f"(median) / alone when started after the schedule, ms:"]
        lines += [f"  pp={r.pp} M={r.microbatches} {r.schedule}: "
                  + " ".join(f"{e:.1f}/{a:.1f}" for e, a in zip(r.bd_exposed_ms, r.bd_alone_ms)) for r in summed]
    ratios = peer_ratios(all_rows)
    if ratios:
        lines += ["", "project / torch, same stages and costs (< 1: the project is faster):"]
        lines += [f"  pp={pp} M={m}: {mine} / {theirs} = {x:.3f}" for pp, m, mine, theirs, x in ratios]
    return "\n".join(lines)


def to_json(cfg: BenchConfig, latencies: Dict[int, Optional[float]], all_rows: Sequence[Row], env: dict) -> dict:
    return {
        "config": {**asdict(cfg), "microbatches": {str(k): list(v) for k, v in cfg.microbatches.items()}},
        "environment": env,
        "p2p_latency_ms": {str(k): v for k, v in latencies.items()},
        "rows": [r.to_json() for r in all_rows],
        "project_over_torch": [dict(pp=pp, microbatches=m, project=a, torch=b, ratio=x)
                               for pp, m, a, b, x in peer_ratios(all_rows)],
    }

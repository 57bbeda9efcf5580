"""Rank 0's view of a benchmark: the ranks' figures against the simulator, as rows, a table
and JSON.

Definitions (per schedule, pp and M):

* measured: per iteration the slowest rank's time; median and range over the timed iterations.
* simulated: the project simulator's makespan for the same costs. ``x sim``: measured over
  simulated with ``p2p=0``; ``x +lat``: over simulated with the measured one-message latency on
  every cross-rank dependency (the gloo part); ``x exec``: over simulated with that latency and
  the costs as the stages really spent them (see "spent"): what remains is the executor's own
  cost, and noise.
* overhead/action: per rank, (iteration time - time in compute - time in P2P calls) / actions:
  the executor's own bookkeeping. The slowest rank's median is shown.
* P2P ms: per rank, time inside the P2P layer's calls (posting and waiting, so it includes
  waiting for a peer that is still computing); median over iterations.
* spent: the compute time the stages really spent (sleeps wake late on a loaded machine) over
  the nominal costs, slowest rank; above 1 it inflates ``x sim`` for every schedule alike.
* peak activations: forwards whose backward has not run yet, counted by the stage compute, against
  the simulator's count; "in flight" is the executor's receive buffers and unfinished sends.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..schedule import build_schedule
from ..schedule.simulate import Costs, simulate
from .measure import BenchConfig, RankRun
from .torch_peer import TORCH_SCHEDULES


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

    @property
    def ratio(self) -> Optional[float]:
        return self.median_ms / self.sim_ms if self.sim_ms else None

    @property
    def ratio_latency(self) -> Optional[float]:
        return self.median_ms / self.sim_latency_ms if self.sim_latency_ms else None

    @property
    def ratio_executor(self) -> Optional[float]:
        return self.median_ms / self.sim_spent_ms if self.sim_spent_ms else None

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(ratio=self.ratio, ratio_latency=self.ratio_latency, ratio_executor=self.ratio_executor)
        return d


def _sim(name: str, pp: int, m: int, costs, p2p: float, scale: float = 1.0):
    s = build_schedule(name, pp, m)
    fb = None if costs.fb is None else costs.fb * scale
    return simulate(s.layout, s.ranks, Costs(f=costs.f * scale, b=costs.b * scale, w=costs.w * scale, fb=fb, p2p=p2p))


def rows(cfg: BenchConfig, pp: int, ranks: Sequence[dict]) -> Tuple[Optional[float], List[Row]]:
    """Combine the per-rank results of one pipeline size into rows (and the latency in ms)."""
    latency = ranks[0]["latency_ms"]
    out: List[Row] = []
    for key in ranks[0]["runs"]:
        runner, name, m = key
        runs: List[RankRun] = [r["runs"][key] for r in ranks]
        iters = [max(r.wall_s[i] for r in runs) * 1e3 for i in range(len(runs[0].wall_s))]
        row = Row(runner, name, pp, m, statistics.median(iters), min(iters), max(iters))
        sim_name = name if runner == "project" else TORCH_SCHEDULES[name][1]
        if runner == "project" or name == "torch-1f1b" or name == "torch-dualpipev":
            sim0 = _sim(sim_name, pp, m, cfg.costs, 0.0)
            row.sim_ms = sim0.makespan
            row.sim_latency_ms = _sim(sim_name, pp, m, cfg.costs, latency or 0.0).makespan
            row.sim_peak_activations = list(sim0.peak_activations)
            row.spent_over_nominal = max(statistics.median(r.compute_s) * 1e3 / busy
                                         for r, busy in zip(runs, sim0.busy) if busy > 0)
            row.sim_spent_ms = _sim(sim_name, pp, m, cfg.costs, latency or 0.0, row.spent_over_nominal).makespan
        if runner == "project":
            row.p2p_ms = [statistics.median(r.p2p_s) * 1e3 for r in runs]
            row.overhead_ms_per_action = max(
                statistics.median((w - c - p) / max(r.actions, 1) for w, c, p in zip(r.wall_s, r.compute_s, r.p2p_s))
                for r in runs) * 1e3
            row.peak_activations = [r.peak_live for r in runs]
            row.peak_in_flight = [r.peak_in_flight for r in runs]
        out.append(row)
    return latency, out


def peer_ratios(all_rows: Sequence[Row]) -> List[Tuple[int, int, str, str, float]]:
    """(pp, M, project schedule, torch schedule, project/torch) for every measured pair."""
    project = {(r.pp, r.microbatches, r.schedule): r for r in all_rows if r.runner == "project"}
    out = []
    for r in all_rows:
        if r.runner != "torch":
            continue
        mine = project.get((r.pp, r.microbatches, TORCH_SCHEDULES[r.schedule][1]))
        if mine is not None:
            out.append((r.pp, r.microbatches, mine.schedule, r.schedule, mine.median_ms / r.median_ms))
    return out


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
        lat = latencies.get(pp)
        lines.append("")
        lines.append(f"pp={pp}: one P2P message (rank 0 <-> 1, half a round trip) {_f(lat, '.2f')} ms")
        head = (f"{'runner':<8} {'schedule':<16} {'M':>3} {'measured ms':>11} {'(min-max)':>13} {'sim ms':>7} "
                f"{'x sim':>6} {'x +lat':>6} {'spent':>5} {'x exec':>6} {'ovh/act':>7}  {'P2P ms per rank':<22} "
                f"{'peak act per rank (sim)':<26} in flight")
        lines.append(head)
        for r in (r for r in all_rows if r.pp == pp):
            lines.append(
                f"{r.runner:<8} {r.schedule:<16} {r.microbatches:>3} {r.median_ms:>11.1f} "
                f"{'(' + f'{r.min_ms:.0f}-{r.max_ms:.0f}' + ')':>13} {_f(r.sim_ms):>7} {_f(r.ratio, '.3f'):>6} "
                f"{_f(r.ratio_latency, '.3f'):>6} {_f(r.spent_over_nominal, '.3f'):>5} {_f(r.ratio_executor, '.3f'):>6} "
                f"{_f(r.overhead_ms_per_action, '.2f'):>7}  {_per_rank(r.p2p_ms, '.0f'):<22} "
                f"{_per_rank(r.peak_activations) + ' (' + _per_rank(r.sim_peak_activations) + ')':<26} "
                f"{_per_rank(r.peak_in_flight)}")
    ratios = peer_ratios(all_rows)
    if ratios:
        lines.append("")
        lines.append("project / torch, same stages and costs (< 1: the project is faster):")
        for pp, m, mine, theirs, x in ratios:
            lines.append(f"  pp={pp} M={m}: {mine} / {theirs} = {x:.3f}")
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

"""``megatron-dualpipe trace DIR``: a recorded run (``MEGATRON_DUALPIPE_TRACE=DIR``, one JSON line
per rank and iteration, :mod:`megatron_dualpipe.executor.trace`) as a Perfetto trace (``--json``)
and as the simulator's picture (``--png``): the measured timeline above the same schedule
simulated with the costs measured in that iteration (per op, the slowest rank's median; P2P 0).

One iteration of one pipeline (default: the last one every rank recorded, of the pipeline
holding the lowest global rank), the ranks aligned on their wall clocks.
"""
from __future__ import annotations

import glob
import json
import os
from typing import List, Optional, Sequence, Tuple

from ..executor.trace import op_medians, slowest_costs  # noqa: F401 - the trace command's costs

HELP = "draw a recorded run (MEGATRON_DUALPIPE_TRACE=DIR) as a Perfetto trace and a measured-vs-simulated PNG"


class TraceError(ValueError):
    """The directory holds no usable recording; the message says what to do."""


def load(directory: str) -> List[dict]:
    files = sorted(glob.glob(os.path.join(directory, "rank*.jsonl")))
    if not files:
        raise TraceError(f"no rank*.jsonl files in {directory}: run with MEGATRON_DUALPIPE_TRACE={directory} "
                         f"(or run_rank(..., trace=TraceRecorder({directory!r}))) first")
    records = []
    for path in files:
        with open(path, encoding="utf-8") as fh:
            records.extend(json.loads(line) for line in fh if line.strip())
    return records


def pick(records: Sequence[dict], call: Optional[int] = None, global_rank: Optional[int] = None) -> List[dict]:
    """The records of one iteration of one pipeline, ordered by pipeline rank."""
    pipelines = sorted({tuple(r["pipeline"]) for r in records}, key=min)
    if global_rank is not None:
        pipelines = [p for p in pipelines if global_rank in p]
        if not pipelines:
            raise TraceError(f"no recorded pipeline holds global rank {global_rank}")
    pipeline = pipelines[0]
    mine = [r for r in records if tuple(r["pipeline"]) == pipeline]
    complete = sorted(c for c in {r["call"] for r in mine}
                      if {r["rank"] for r in mine if r["call"] == c} == set(range(len(pipeline))))
    if not complete:
        raise TraceError(f"no iteration was recorded by every rank of pipeline {list(pipeline)}: copy all ranks' "
                         f"files into one directory")
    if call is None:
        call = complete[-1]
    elif call not in complete:
        raise TraceError(f"iteration {call} was not recorded by every rank; recorded: {complete}")
    return sorted((r for r in mine if r["call"] == call), key=lambda r: r["rank"])


def measured(ranks: Sequence[dict]):
    """(schedule, timeline in ms, waits per rank as (start, end) in ms) of one iteration."""
    from ..schedule import Action, Schedule, build_schedule
    from ..schedule.simulate import RankTimeline, SimResult

    first = ranks[0]
    layout = build_schedule(first["schedule"], first["pp"], first["microbatches"]).layout
    acts = tuple(tuple(Action.from_json(a) for a in r["actions"]) for r in ranks)
    schedule = Schedule(first["schedule"], first["pp"], first["microbatches"], layout, acts)
    origin = min(r["wall_start"] + (r["units"][0][1] if r["units"] else 0.0) for r in ranks)
    timelines, waits = [], []
    for r, a in zip(ranks, acts):
        shift = r["wall_start"] - origin
        tl = RankTimeline(starts=[0.0] * len(a), ends=[0.0] * len(a))
        rank_waits = []
        for indices, waited, started, ended in r["units"]:
            s, e = (shift + started) * 1e3, (shift + ended) * 1e3
            for i in indices:
                tl.starts[i], tl.ends[i] = s, e
            tl.busy += e - s
            if started - waited > 5e-5:
                rank_waits.append(((shift + waited) * 1e3, s))
        timelines.append(tl)
        waits.append(rank_waits)
    makespan = max((max(tl.ends, default=0.0) for tl in timelines), default=0.0)
    return schedule, SimResult(makespan, timelines), waits


def chrome_trace(schedule, panels: Sequence[Tuple[str, object]], waits: Sequence[Sequence[Tuple[float, float]]]) -> dict:
    """Perfetto / Chrome trace events: a process per panel, a track per rank, times in us."""
    from ..schedule.actions import units

    events: List[dict] = []
    for pid, (name, result) in enumerate(panels):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
        for r, (acts, tl) in enumerate(zip(schedule.ranks, result.ranks)):
            events.append({"ph": "M", "pid": pid, "tid": r, "name": "thread_name", "args": {"name": f"rank {r}"}})
            for u in units(acts):
                a = acts[u[0]]
                label = "+".join(str(acts[i]).rstrip("+") for i in u)
                events.append({"ph": "X", "pid": pid, "tid": r, "name": label, "cat": "+".join(acts[i].op for i in u),
                               "ts": tl.starts[u[0]] * 1e3, "dur": (tl.ends[u[0]] - tl.starts[u[0]]) * 1e3,
                               "args": {"stage": a.stage, "dir": a.dir, "mb": a.mb, "index": u[0]}})
            if pid == 0:
                for s, e in waits[r]:
                    events.append({"ph": "X", "pid": pid, "tid": r, "name": "wait", "cat": "p2p", "ts": s * 1e3,
                                   "dur": (e - s) * 1e3})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def run(args) -> int:
    from ..schedule.simulate import simulate

    ranks = pick(load(args.directory), args.iteration, args.global_rank)
    schedule, real, waits = measured(ranks)
    costs = slowest_costs([op_medians(r) for r in ranks])
    sim = simulate(schedule.layout, schedule.ranks, costs)
    fb = "" if costs.fb is None else f" fb={costs.fb:.2f}"
    cost_text = f"f={costs.f:.2f} b={costs.b:.2f} w={costs.w:.2f}{fb} ms"
    panels = [(f"measured: {schedule.name} pp={schedule.pp} M={schedule.microbatches}, iteration "
               f"{ranks[0]['call']}, {real.makespan:.1f} ms", real),
              (f"simulated with the measured costs (per op the slowest rank's median: {cost_text}, p2p 0): "
               f"{sim.makespan:.1f} ms", sim)]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(chrome_trace(schedule, [("measured", real), ("simulated", sim)], waits), fh)
    if args.png:
        from .figure import stacked_figure
        from .plotting import save_png

        save_png(stacked_figure(schedule, panels), args.png)
    print(f"{schedule.name} pp={schedule.pp} M={schedule.microbatches}, iteration {ranks[0]['call']} of pipeline "
          f"{ranks[0]['pipeline']}: measured {real.makespan:.1f} ms, simulated {sim.makespan:.1f} ms "
          f"({real.makespan / sim.makespan if sim.makespan else float('nan'):.3f}x) with {cost_text}")
    for r, (tl, w) in enumerate(zip(real.ranks, waits)):
        waited = sum(e - s for s, e in w)
        print(f"  rank {r}: busy {tl.busy:.1f} ms, waited for inputs {waited:.1f} ms, "
              f"idle otherwise {real.makespan - tl.busy - waited:.1f} ms")
    return 0

"""Simulated pipeline bubbles against the closed-form formulas, as a markdown report.

    PYTHONPATH=. python tools/gen_docs.py          # writes docs/bubbles.md and its figure (all generated docs)
    PYTHONPATH=. python tools/bubble_report.py     # prints the report only

Costs are hypothetical time units (no measurement); in the first table they are per action,
so DualPipeV's are per chunk (half a stage); the second table puts every schedule on the same
model (``costs.compare``). Bubble = makespan - busy time of a rank, maximum over ranks.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dualpipe.schedule import build_schedule  # noqa: E402
from megatron_dualpipe.schedule.registry import spec as get  # noqa: E402
from megatron_dualpipe.costs.compare import compare  # noqa: E402
from megatron_dualpipe.schedule.registry import DUALPIPE, DUALPIPEV, ONE_F_ONE_B, distinct_orders  # noqa: E402
from megatron_dualpipe.schedule.simulate import Costs, simulate  # noqa: E402

PPS = (4, 8, 16)
COSTS = (Costs(f=1, b=2, w=1, fb=3), Costs(f=1, b=2, w=0.5, fb=2.5), Costs(f=1, b=2, w=1, fb=2.5))


def _n(x) -> str:
    if x is None:
        return "-"
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def microbatches(pp: int) -> int:
    return 4 * pp  # full steady state for every schedule; the bubble does not depend on M beyond 2*pp


def rows():
    for costs in COSTS:
        for name in distinct_orders():
            for pp in PPS:
                m = microbatches(pp)
                s = build_schedule(name, pp, m)
                res = simulate(s.layout, s.ranks, costs)
                sim = max(res.bubble)
                form = get(name).formula_bubble(pp, costs)
                yield costs, name, pp, m, res.makespan, sim, form, max(res.peak_activations)


#: Stage costs of the same-model table: twice the first setting's, so DualPipeV's chunks cost f=1 b=2 w=1 fb=3.
SAME_MODEL = Costs(f=2, b=4, w=2, fb=6)


def same_model_rows():
    for pp in PPS:
        for row in compare(pp, microbatches(pp), SAME_MODEL):
            yield pp, row


def same_model() -> list:
    c = SAME_MODEL
    out = ["## The same model under each schedule", "",
           "The table above gives every schedule the same costs *per action*. For one model that is not a fair "
           "race: 1F1B, ZB-H1 and DualPipe run a whole stage (1/pp of the model) per action, DualPipeV a chunk of "
           "half a stage. Below, every schedule runs the same model whose stage costs "
           f"f={_n(c.f)}, b={_n(c.b)}, w={_n(c.w)}, fb={_n(c.fused)} (DualPipeV's chunks: half of each), as "
           "`megatron-dualpipe simulate` and `advise` compare them. Peak activations are in stages' worth of one "
           "micro-batch (a DualPipeV chunk counts half); parameters are stages' worth per rank (DualPipe holds a "
           "mirrored copy).", "",
           "| pp | M | schedule | makespan | bubble | peak activations (stages) | parameters (stages per rank) |",
           "|---:|---:|---|---:|---:|---:|---:|"]
    for pp, r in same_model_rows():
        out.append(f"| {pp} | {r.microbatches} | {r.name} | {_n(r.makespan)} | {_n(r.bubble)} | "
                   f"{_n(r.peak_activations)} | {_n(r.parameter_copies)} |")
    return out + [""]


# -- What an overlapped F&B unit buys -------------------------------------------------------------

#: Stage costs of the overlap section (DeepSeek's setting w = f = b/2); fb is set per overlap ratio.
STAGE = Costs(f=1, b=2, w=1)
OVERLAP_RATIOS = (0.0, 0.5, 1.0)
OVERLAP_PPS = (8, 16, 32)
OVERLAP_SCHEDULES = (ONE_F_ONE_B, DUALPIPE, DUALPIPEV)


def fused_cost(stage: Costs, r: float) -> float:
    """A fused F&B unit when a fraction ``r`` of the shorter of F and B hides behind the other."""
    return stage.f + stage.b - r * min(stage.f, stage.b)


def overlap_rows():
    """(r, fb, pp, compare.Row, fused units on rank 0, makespan / 1F1B's) on the same model."""
    for r in OVERLAP_RATIOS:
        fb = fused_cost(STAGE, r)
        for pp in OVERLAP_PPS:
            rows = compare(pp, microbatches(pp), Costs(f=STAGE.f, b=STAGE.b, w=STAGE.w, fb=fb), OVERLAP_SCHEDULES)
            base = rows[0].makespan
            for row in rows:
                fused = sum(1 for a in build_schedule(row.name, pp, row.microbatches).ranks[0] if a.overlap)
                yield r, fb, pp, row, fused, row.makespan / base


def overlap_section() -> list:
    f, b, w = (_n(x) for x in (STAGE.f, STAGE.b, STAGE.w))
    out = ["## What an overlapped F&B unit buys", "",
           f"The same model (stage costs f={f}, b={b}, w={w}; DualPipeV's chunks: half of each, as in the table "
           "above). A fused F&B unit runs one direction's forward with the other direction's backward; if a "
           "fraction r of the shorter of the two hides behind the other (MoE all-to-all behind compute, on a GPU: "
           "`--overlap-moe-expert-parallel-comm`), it costs `fb = f + b - r*min(f, b)` per stage: r=0 is F then B, "
           "r=1 hides F entirely. 1F1B has no fused units (megatron-core overlaps only in its interleaved combined "
           "1F1B, with a virtual pipeline; not modelled), so r changes nothing for it. The simulator takes the F&B "
           "cost separately (`Costs.fb`; `megatron-dualpipe simulate --fb`), so a measured fused-unit time can "
           "replace the hypothetical one. M = 4*pp; fused units counted on rank 0.", "",
           "| r | fb (per stage) | pp | M | schedule | makespan | bubble | closed form | fused units | "
           "makespan / 1F1B |",
           "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    rows = list(overlap_rows())
    for r, fb, pp, row, fused, rel in rows:
        out.append(f"| {_n(r)} | {_n(fb)} | {pp} | {row.microbatches} | {row.name} | {_n(row.makespan)} | "
                   f"{_n(row.bubble)} | {_n(row.formula)} | {fused} | {rel:.3f} |")
    rel = {(r, row.name, pp): x for r, _, pp, row, _, x in rows}
    exact = all(row.bubble == row.formula for _, _, _, row, _, _ in rows)
    pp, lo, hi = OVERLAP_PPS[-1], OVERLAP_RATIOS[0], OVERLAP_RATIOS[-1]
    out += ["", "Reading the table:", "",
            f"* The overlap shortens every fused unit, not only the bubble: DualPipe fuses most of its steady "
            f"state, so at pp={pp} its iteration takes {rel[(lo, DUALPIPE, pp)]:.2f} of 1F1B's with r={_n(lo)} "
            f"(bubble only) and {rel[(hi, DUALPIPE, pp)]:.2f} with r={_n(hi)}; DualPipeV "
            f"{rel[(lo, DUALPIPEV, pp)]:.2f} and {rel[(hi, DUALPIPEV, pp)]:.2f}.",
            "* DualPipeV, with the same work per iteration, has nearly DualPipe's bubble (`pp-1` chunk stages of "
            "half cost against DualPipe's `pp/2-1` full ones) and holds half of DualPipe's parameters per rank.",
            "* The simulated bubble equals the closed form in every row." if exact else
            "* The simulated bubble differs from the closed form in some rows (see the columns).",
            "* Hypothetical costs: what r a real MoE model reaches depends on how much all-to-all there is to "
            "hide (GPU only: on the CPU the combined step runs its sub-steps in order and overlaps nothing).", ""]
    return out


def report() -> str:
    out = ["# Pipeline bubbles: simulator vs closed forms", "",
           "Generated by `PYTHONPATH=. python tools/gen_docs.py` (checked by `tests/cli/test_docs.py`).", "",
           "Hypothetical costs (no timing): `f` forward, `b` full backward, `w` its weight-gradient part "
           "(an input-only B costs `b-w`), `fb` one fused F&B unit, no p2p latency. DualPipeV costs are per "
           "chunk (half a stage). Bubble = makespan - busy time, maximum over ranks; peak activations = "
           "most forwards whose backward has not run yet on one rank, maximum over ranks (chunks for "
           "DualPipeV). M = 4*pp micro-batches (DualPipe: both directions together).", "",
           "Closed forms: " + "; ".join(f"{k} `{get(k).bubble_formula}`" for k in distinct_orders()) + ". Interleaved "
           "1F1B (Megatron's virtual pipeline, v=2 chunks per rank, simulated only) is given the same costs per "
           "chunk as the others per stage; with the EP all-to-all overlap every steady step is one fused unit "
           "(`fb`).", "",
           "| costs (f, b, w, fb) | schedule | pp | M | makespan | simulated bubble | formula | difference | peak activations |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for costs, name, pp, m, mk, sim, form, peak in rows():
        c = f"{_n(costs.f)}, {_n(costs.b)}, {_n(costs.w)}, {_n(costs.fused)}"
        diff = None if form is None else sim - form
        out.append(f"| {c} | {name} | {pp} | {m} | {_n(mk)} | {_n(sim)} | {_n(form)} | {_n(diff)} | {peak} |")
    out += ["", "Observations:", "",
            "* 1F1B matches `(pp-1)(f+b)` exactly for every cost setting, and its peak activations are "
            "`pp - rank` on rank `rank`.",
            "* ZB-H1 matches `(pp-1)(f+b-2w)` exactly whenever `w <= f` and `w <= b-w`; otherwise the "
            "simulated bubble is larger by `(pp-1)(w - min(f, b-w))` (W no longer fits the gaps). "
            "All three settings here satisfy the condition.",
            "* DualPipe and DualPipeV match `(pp/2-1)(fb+b-3w)` / `(pp-1)(fb+b-3w)` exactly at DeepSeek's "
            "setting `w = f = b/2` (with `fb = f+b` or `fb = 2.5`). With `w = 0.5` the simulated bubble is "
            "smaller than the formula by a constant 1 (0.5 for DualPipe pp=4) that does not grow with pp: "
            "the per-stage term `fb+b-3w` holds, only the warm-up/cool-down end effect differs. "
            "`tests/schedule/test_simulate.py` prints more settings (`pytest -q -s`); other settings differ in "
            "either direction (larger, growing with pp, for example when `fb > f+b`, `w > f` or `f = 2w`).",
            "* DualPipeV on pp ranks times exactly like ranks 0..pp-1 of DualPipe on 2*pp ranks "
            "(DeepSeek's \"cut-in-half\" DualPipe).",
            "* Peak activations: DualPipe `pp+1` (DeepSeek's table), DualPipeV `2pp+1` chunks "
            "(= pp+1/2 stages), 1F1B and ZB-H1 `pp`.",
            "* The rows above compare DualPipeV at per-chunk costs with 1F1B at the same costs per stage "
            "(at pp=4 with fb=2.5: 4.5 against 9). On one model 1F1B's stage costs twice a chunk, so its bubble "
            "is twice that, 18: see the next table.", "",
            *same_model(),
            *overlap_section(),
            "![DualPipe pp=8 M=20](dualpipe_pp8_m20.png)", "",
            "`docs/dualpipe_pp8_m20.png` / `.svg`: DualPipe, pp=8, M=20, costs f=1 b=2 w=1 fb=3 (drawn with "
            "`megatron-dualpipe simulate --schedule dualpipe --pp 8 --microbatches 20 --fb 3 --png ... --svg ...`). "
            "Colours tell the op (Okabe-Ito palette, readable with the common colour-vision deficiencies); "
            "solid: direction 0 (enters at rank 0); light and hatched: direction 1 (enters at rank 7); "
            "thick outline: a fused F&B unit.", ""]
    return "\n".join(out)


FIGURE = "dualpipe_pp8_m20"


def figure():
    """The schedule and simulation drawn in docs/dualpipe_pp8_m20.{png,svg}."""
    s = build_schedule(DUALPIPE, 8, 20)
    return s, simulate(s.layout, s.ranks, Costs(f=1, b=2, w=1, fb=3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())

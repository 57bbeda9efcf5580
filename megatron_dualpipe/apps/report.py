"""What the main job shows at the end: the loss table, ``loss.png`` and ``summary.md``; pure
functions of the two runs' results (:class:`RunResult`), tested without training anything.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

#: How many first and last rows of the loss table ``summary.md`` shows.
SUMMARY_ROWS = 5


@dataclass
class RunResult:
    """One schedule's training run, as the last pipeline rank saw it."""

    name: str
    losses: List[float]                 # mean lm loss per iteration
    valid_loss: Optional[float] = None  # mean lm loss on the held-out batches after training
    seconds: float = 0.0                # wall time of the training iterations
    tokens_per_second: float = 0.0


def differences(a: RunResult, b: RunResult) -> List[float]:
    return [x - y for x, y in zip(a.losses, b.losses)]


def max_difference(a: RunResult, b: RunResult) -> float:
    return max((abs(d) for d in differences(a, b)), default=0.0)


def print_comparison(dual: RunResult, one: RunResult, schedule: str, pp: int, microbatches: int) -> None:
    """The job's last lines: losses, their largest difference, validation, times, simulated makespans."""
    print("\n" + "\n".join(loss_table(dual, one)))
    largest = max_difference(dual, one)
    print(f" max |{dual.name} - 1f1b| over {len(dual.losses)} iterations: {largest:.3e} "
          f"({largest / max(abs(x) for x in one.losses):.1e} of the loss; fp32 sums in another order, "
          f"which Adam's steps carry on)")
    if dual.valid_loss is not None and one.valid_loss is not None:
        print(f" validation lm loss after {len(dual.losses)} iterations: {dual.name} {dual.valid_loss:.6f}, "
              f"{one.name} {one.valid_loss:.6f}, difference {abs(dual.valid_loss - one.valid_loss):.2e}")
    print(f" training time: {dual.name} {dual.seconds:.1f} s ({dual.tokens_per_second:,.0f} tokens/s), "
          f"1f1b {one.seconds:.1f} s ({one.tokens_per_second:,.0f} tokens/s)", flush=True)
    print(f" simulated {simulated_text(simulated_pair(schedule, pp, microbatches)[1])}\n {WHY_NOT_WALL_TIME}",
          flush=True)


def loss_table(a: RunResult, b: RunResult, rows: Optional[Sequence[int]] = None) -> List[str]:
    """Side-by-side lines: iteration, both losses, |difference| (all iterations by default)."""
    lines = [f" {'iteration':>9} | {a.name:>12} | {b.name:>12} | difference"]
    shown = list(range(len(a.losses)) if rows is None else rows)
    for previous, i in zip([-1] + shown, shown):
        if i != previous + 1:
            lines.append(f" {'...':>9} |")
        lines.append(f" {i + 1:>9} | {a.losses[i]:12.6f} | {b.losses[i]:12.6f} | {abs(a.losses[i] - b.losses[i]):.2e}")
    return lines


def head_and_tail(n: int, k: int = SUMMARY_ROWS) -> List[int]:
    return list(range(n)) if n <= 2 * k else list(range(k)) + list(range(n - k, n))


def loss_figure(a: RunResult, b: RunResult, title: str):
    """Both training curves (validation losses as markers) above their difference."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    from ..pictures.plotting import agg_pyplot, legend_below

    plt = agg_pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.0, 4.6), dpi=100, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    its = list(range(1, len(a.losses) + 1))
    handles = top.plot(its, a.losses, color="#3c78b5", linewidth=2.4, label=f"{a.name}, training")
    handles += top.plot(its, b.losses, color="#f28e2b", linewidth=1.2, linestyle="--", label=f"{b.name}, training")
    if a.valid_loss is not None and b.valid_loss is not None:
        for r, marker, color, edge in ((a, "o", "#3c78b5", {}), (b, "x", "#f28e2b", {"markeredgewidth": 2})):
            top.plot([its[-1]], [r.valid_loss], marker=marker, markersize=9, color=color, linestyle="none", **edge)
            handles.append(Line2D([], [], marker=marker, color=color, linestyle="none", label=f"{r.name}, validation",
                                  **edge))
    top.set_ylabel("lm loss")
    top.set_title(title, fontsize=10, loc="left")
    top.grid(color="#e4e4e4", linewidth=0.6)
    diff = differences(a, b)
    bottom.axhline(0.0, color="#888888", linewidth=0.8)
    bottom.plot(its, diff, color="#8e5aa8", marker=".", linewidth=1.0)
    bound = max(max((abs(d) for d in diff), default=0.0) * 1.3, 1e-7)
    bottom.set(ylim=(-bound, bound), xlabel="iteration")
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    bottom.set_ylabel(f"{a.name} - {b.name}", fontsize=8)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.grid(color="#e4e4e4", linewidth=0.6)
    legend_below(fig, handles, fontsize=8, max_columns=4)
    return fig


def write_loss_png(path: str, a: RunResult, b: RunResult, title: str) -> None:
    from ..pictures.plotting import save_png

    save_png(loss_figure(a, b, title), path)


# --- Measured timeline: timeline.png + trace.json from the executor's recording of one iteration ---

def write_measured_timeline(records_dir: str, out_dir: str) -> None:
    """``megatron-dualpipe trace records_dir --png timeline.png --json trace.json`` into ``out_dir``,
    for the fastest recorded iteration (the least disturbed by other work on the machine)."""
    import argparse

    from ..pictures import timeline

    records = timeline.load(records_dir)
    calls = sorted({r["call"] for r in records})
    fastest = min(calls, key=lambda c: timeline.measured(timeline.pick(records, c))[1].makespan)
    print(f"measured timeline: the fastest of {len(calls)} recorded DualPipe iterations (recorded call {fastest})")
    png, trace = (os.path.join(out_dir, f) for f in ("timeline.png", "trace.json"))
    timeline.run(argparse.Namespace(directory=records_dir, png=png, json=trace, iteration=fastest, global_rank=None))


# --- DualPipe against 1F1B, simulated on the same model at the same scale ---------------------

#: Why the main job's wall times do not show DualPipe's smaller bubbles (printed and in summary.md).
WHY_NOT_WALL_TIME = ("CPU wall time does not show bubbles: the ranks share a few cores, so while one rank "
                     "idles in a bubble another rank computes on its core and the job takes about its total "
                     "compute over the cores, whatever the schedule; with a GPU per rank an idle rank's time "
                     "is lost, which is what the simulated makespans compare.")


def compare_file(name: str, pp: int, real: int) -> str:
    return f"{name}_vs_1f1b_pp{pp}_m{real}.png"


def simulated_pair(name: str, pp: int, real: int):
    """``name`` and megatron-core's 1F1B on the same model (stage costs f=1, b=2, w=1; DualPipeV's
    chunks half a stage; fake micro-batches free): [(heading, schedule, timeline)] and their makespans."""
    from ..costs.compare import build_padded, stage_fraction
    from ..schedule.registry import ONE_F_ONE_B
    from ..schedule.simulate import Costs, simulate

    panels, makespans = [], []
    for n in (name, ONE_F_ONE_B):
        padded = build_padded(n, pp, real)
        s = padded.schedule
        result = simulate(s.layout, s.ranks, padded.costs(Costs().scaled(stage_fraction(s.spec, pp))))
        makespans.append((n, result.makespan))
        panels.append((f"{n}: pp={pp}, {real} micro-batches, makespan {result.makespan:g} (forward = 1, "
                       f"backward = 2 per stage)", s, result))
    return panels, makespans


def simulated_text(makespans, note: str = "") -> str:
    """The simulated makespans compared, for the job's output and its summary."""
    (a, ta), (b, tb) = makespans
    return (f"on the same model (forward 1, backward 2 per stage): {a} makespan {ta:g}, {b} {tb:g} "
            f"({a} takes {ta / tb:.2f}x of {b}'s time{note})")


def write_schedule_comparison(out_dir: str, name: str, pp: int, real: int) -> str:
    """``<name>_vs_1f1b_pp<P>_m<M>.png`` in ``out_dir``: both simulated timelines on one time axis."""
    from ..pictures.figure import panels_figure
    from ..pictures.plotting import save_png

    panels, _ = simulated_pair(name, pp, real)
    path = os.path.join(out_dir, compare_file(name, pp, real))
    save_png(panels_figure(panels, shared_axis=True, time_label="simulated time (forward = 1)"), path)
    return path


def summary_markdown(a: RunResult, b: RunResult, settings: Sequence[str], data: Sequence[str],
                     pictures: Sequence[str], simulated: Sequence[Tuple[str, float]] = ()) -> str:
    """``summary.md``: settings, data, results, simulated makespans, the loss table's head and tail."""
    n = len(a.losses)
    out = ["# megatron-dualpipe main job", "", "## Set-up", ""]
    out += [f"- {line}" for line in settings]
    out += ["", "## Data", ""] + [f"- {line}" for line in data]
    out += ["", "## Results", "",
            "| schedule | first loss | last loss | validation loss | training time (s) | tokens/s |",
            "|---|---|---|---|---|---|"]
    for r in (a, b):
        valid = "-" if r.valid_loss is None else f"{r.valid_loss:.6f}"
        out.append(f"| {r.name} | {r.losses[0]:.6f} | {r.losses[-1]:.6f} | {valid} | {r.seconds:.1f} | "
                   f"{r.tokens_per_second:,.0f} |")
    out += ["", f"Largest |{a.name} - {b.name}| training loss over {n} iterations: {max_difference(a, b):.3e}."]
    if a.valid_loss is not None and b.valid_loss is not None:
        out.append(f"Validation losses differ by {abs(a.valid_loss - b.valid_loss):.3e}.")
    if simulated:
        out += ["", f"Simulated {simulated_text(simulated, '; the two timelines are drawn at the same scale below')}. "
                f"{WHY_NOT_WALL_TIME}"]
    out += ["", "```"] + loss_table(a, b, head_and_tail(n)) + ["```", "", "## Pictures", ""]
    out += [f"![{os.path.splitext(p)[0]}]({p})" for p in pictures]
    return "\n".join(out) + "\n"

"""What the main job shows at the end: the loss table, ``loss.png`` and ``summary.md``.

Pure functions of the two runs' results (:class:`RunResult`), so they are tested without
training anything. matplotlib is imported only by :func:`loss_figure`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

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
    iteration_ms: List[float] = field(default_factory=list)


def differences(a: RunResult, b: RunResult) -> List[float]:
    return [x - y for x, y in zip(a.losses, b.losses)]


def max_difference(a: RunResult, b: RunResult) -> float:
    return max((abs(d) for d in differences(a, b)), default=0.0)


def loss_table(a: RunResult, b: RunResult, rows: Optional[Sequence[int]] = None) -> List[str]:
    """Side-by-side lines: iteration, both losses, |difference| (all iterations by default)."""
    lines = [f" {'iteration':>9} | {a.name:>12} | {b.name:>12} | difference"]
    shown = range(len(a.losses)) if rows is None else rows
    previous = -1
    for i in shown:
        if i != previous + 1:
            lines.append(f" {'...':>9} |")
        lines.append(f" {i + 1:>9} | {a.losses[i]:12.6f} | {b.losses[i]:12.6f} | {abs(a.losses[i] - b.losses[i]):.2e}")
        previous = i
    return lines


def head_and_tail(n: int, k: int = SUMMARY_ROWS) -> List[int]:
    return list(range(n)) if n <= 2 * k else list(range(k)) + list(range(n - k, n))


def validation_lines(a: RunResult, b: RunResult) -> List[str]:
    if a.valid_loss is None or b.valid_loss is None:
        return []
    return [f" validation lm loss after {len(a.losses)} iterations: {a.name} {a.valid_loss:.6f}, "
            f"{b.name} {b.valid_loss:.6f}, difference {abs(a.valid_loss - b.valid_loss):.2e}"]


# ---------------------------------------------------------------------------------------------
# loss.png
# ---------------------------------------------------------------------------------------------

def loss_figure(a: RunResult, b: RunResult, title: str, dpi: int = 100):
    """Both training curves (validation losses as markers) above their difference."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    from .plotting import agg_pyplot, legend_below

    plt = agg_pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.0, 4.6), dpi=dpi, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    its = list(range(1, len(a.losses) + 1))
    top.plot(its, a.losses, color="#3c78b5", linewidth=2.4)
    top.plot(its, b.losses, color="#f28e2b", linewidth=1.2, linestyle="--")
    handles = [Line2D([], [], color="#3c78b5", linewidth=2.4, label=f"{a.name}, training"),
               Line2D([], [], color="#f28e2b", linewidth=1.2, linestyle="--", label=f"{b.name}, training")]
    if a.valid_loss is not None and b.valid_loss is not None:
        top.plot([its[-1]], [a.valid_loss], marker="o", markersize=9, color="#3c78b5", linestyle="none")
        top.plot([its[-1]], [b.valid_loss], marker="x", markersize=9, markeredgewidth=2, color="#f28e2b",
                 linestyle="none")
        handles += [Line2D([], [], marker="o", color="#3c78b5", linestyle="none", label=f"{a.name}, validation"),
                    Line2D([], [], marker="x", markeredgewidth=2, color="#f28e2b", linestyle="none",
                           label=f"{b.name}, validation")]
    top.set_ylabel("lm loss")
    top.set_title(title, fontsize=10, loc="left")
    top.grid(color="#e4e4e4", linewidth=0.6)
    diff = differences(a, b)
    bottom.axhline(0.0, color="#888888", linewidth=0.8)
    bottom.plot(its, diff, color="#8e5aa8", marker=".", linewidth=1.0)
    bound = max(max((abs(d) for d in diff), default=0.0) * 1.3, 1e-7)
    bottom.set_ylim(-bound, bound)
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    bottom.set_ylabel(f"{a.name} - {b.name}", fontsize=8)
    bottom.set_xlabel("iteration")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.grid(color="#e4e4e4", linewidth=0.6)
    legend_below(fig, handles, fontsize=8, max_columns=4)
    return fig


def write_loss_png(path: str, a: RunResult, b: RunResult, title: str) -> None:
    from .plotting import agg_pyplot

    fig = loss_figure(a, b, title)
    try:
        fig.savefig(path, format="png")
    finally:
        agg_pyplot().close(fig)


# ---------------------------------------------------------------------------------------------
# Measured timeline: timeline.png + trace.json from the executor's recording of one iteration
# ---------------------------------------------------------------------------------------------

MEASURED_TIMELINE_FILES = ("timeline.png", "trace.json")


def write_measured_timeline(records_dir: str, out_dir: str) -> None:
    """``timeline.png`` (a measured iteration above its simulation with the measured median
    costs) and ``trace.json`` (Chrome / Perfetto) in ``out_dir``, from the executor's recording
    (``MEGATRON_DUALPIPE_TRACE``) in ``records_dir``; prints measured against simulated time.
    Of several recorded iterations it draws the fastest (the least disturbed by other work on
    the machine); otherwise the same as ``megatron-dualpipe trace records_dir --iteration N
    --png ... --json ...``."""
    import argparse

    from . import timeline

    records = timeline.load(records_dir)
    calls = sorted({r["call"] for r in records})
    fastest = min(calls, key=lambda c: timeline.measured(timeline.pick(records, c))[1].makespan)
    print(f"measured timeline: the fastest of {len(calls)} recorded DualPipe iterations (recorded call {fastest})")
    png, trace = (os.path.join(out_dir, f) for f in MEASURED_TIMELINE_FILES)
    timeline.run(argparse.Namespace(directory=records_dir, png=png, json=trace, iteration=fastest, global_rank=None))


# ---------------------------------------------------------------------------------------------
# summary.md
# ---------------------------------------------------------------------------------------------

def summary_markdown(a: RunResult, b: RunResult, settings: Sequence[str], data: Sequence[str],
                     pictures: Sequence[str]) -> str:
    """A short Markdown report: settings, data, results, the loss table's head and tail."""
    n = len(a.losses)
    out = ["# megatron-dualpipe main job", "", "## Set-up", ""]
    out += [f"- {line}" for line in settings]
    out += ["", "## Data", ""] + [f"- {line}" for line in data]
    out += ["", "## Results", "",
            f"| schedule | first loss | last loss | validation loss | training time (s) | tokens/s |",
            "|---|---|---|---|---|---|"]
    for r in (a, b):
        valid = "-" if r.valid_loss is None else f"{r.valid_loss:.6f}"
        out.append(f"| {r.name} | {r.losses[0]:.6f} | {r.losses[-1]:.6f} | {valid} | {r.seconds:.1f} | "
                   f"{r.tokens_per_second:,.0f} |")
    out += ["", f"Largest |{a.name} - {b.name}| training loss over {n} iterations: {max_difference(a, b):.3e}."]
    if a.valid_loss is not None and b.valid_loss is not None:
        out.append(f"Validation losses differ by {abs(a.valid_loss - b.valid_loss):.3e}.")
    out += ["", "```"] + loss_table(a, b, head_and_tail(n)) + ["```", "", "## Pictures", ""]
    out += [f"![{os.path.splitext(p)[0]}]({p})" for p in pictures]
    return "\n".join(out) + "\n"

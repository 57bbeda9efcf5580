"""The drawing of :mod:`.draw` painted with matplotlib (Agg, imported when a figure is made): one
timeline (PNG), or several one above the other. One collection per fill, not a patch per cell,
and labels kept out of ``tight_layout``: a few thousand cells render in seconds.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ..schedule.simulate import SimResult
from .draw import (COLORS, FAKE, HATCHED, TEXT, UNIT_PX, Fake, Frame, boxes, frame, key, label, label_size,
                   legend_entries, legend_marks, num, outlines, ticks, ticks_that_fit, title, whole)
from .plotting import agg_pyplot, legend_below, save_png

#: Label sizes (points) tried per cell, largest first; a cell too narrow for 5 pt gets none.
LABEL_SIZES = (8, 7, 6, 5)
#: Resolution of every figure here.
DPI = 110
#: Width of the drawing area of a stacked figure, in inches.
STACKED_WIDTH = 16.0
#: Row height and the gap between rows, in the axes' units.
_ROW, _GAP = 1.0, 0.14


def _hatch_kwargs(d: int, op: str) -> dict:
    """matplotlib keyword arguments for a hatched cell (``hatchcolor`` where matplotlib has it)."""
    if d not in HATCHED:
        return {}
    import matplotlib

    major, minor = (int(x) for x in matplotlib.__version__.split(".")[:2])
    return {"hatch": "///", **({"hatchcolor": COLORS[(op, 0)]} if (major, minor) >= (3, 10) else {})}


def _box(x0: float, x1: float, y: float, h: float):
    return ((x0, y), (x1, y), (x1, y + h), (x0, y + h))


def _paint(ax, schedule, result: SimResult, fr: Frame, points_per_time: float, fake: Fake = None) -> None:
    """One timeline on ``ax``: a row per drawn rank, a cell per drawn action (its micro-batch number
    in the largest of :data:`LABEL_SIZES` that fits, none if 5 pt does not), thick outlines on
    fused units, grey marks for fakes, the cut-out steady state shaded. The caller sets the x axis."""
    from matplotlib.collections import PolyCollection

    n = len(fr.rows)
    groups: Dict[object, List] = {}
    for c, row, x0, x1, is_fake in boxes(schedule, result, fr, fake):
        a, y = c.action, (n - 1 - row) * (_ROW + _GAP)
        if is_fake:
            groups.setdefault("fake", []).append(_box(x0, max(x1, x0 + fr.avg_unit * 0.05), y, _ROW))
            continue
        groups.setdefault((a.op, a.dir), []).append(_box(x0, x1, y, _ROW))
        size = label_size(len(label(a)), (x1 - x0) * points_per_time, LABEL_SIZES)
        if size:
            ax.text((x0 + x1) / 2, y + _ROW / 2, label(a), ha="center", va="center", fontsize=size,
                    color=TEXT, clip_on=True).set_in_layout(False)
    for row, x0, x1 in outlines(schedule, result, fr):
        groups.setdefault("fused", []).append(_box(x0, x1, (n - 1 - row) * (_ROW + _GAP), _ROW))
    for k, rects in groups.items():
        if k == "fake":
            style = dict(facecolor=FAKE, edgecolor="none")
        elif k == "fused":
            style = dict(facecolor="none", edgecolor="#111111", linewidth=1.8, zorder=3)
        else:
            style = dict(facecolor=COLORS[k], edgecolor="white", linewidth=0.6, **_hatch_kwargs(k[1], k[0]))
        coll = PolyCollection(rects, **style)
        coll.set_in_layout(False)
        ax.add_collection(coll)
    if len(fr.segments) > 1:
        gx = fr.segments[0][1] - fr.segments[0][0]
        ax.axvspan(gx, gx + fr.gap, color="#f0f0f0", zorder=0)
        ax.text(gx + fr.gap / 2, n * (_ROW + _GAP) / 2, "...", ha="center", va="center", color="#666666")
    ax.set_ylim(-_GAP, n * (_ROW + _GAP))
    ax.set_yticks([(n - 1 - i) * (_ROW + _GAP) + _ROW / 2 for i in range(n)])
    ax.set_yticklabels([f"rank {r}" if r is not None else "..." for r in fr.rows])
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#e4e4e4", linewidth=0.6)
    ax.set_axisbelow(True)


def _legend_handles(schedules: Sequence, fake: bool) -> list:
    """One legend entry per fill the schedules use (the same fill means the same in every panel),
    then the fused outline and the fake mark where drawn."""
    from matplotlib.patches import Patch

    handles, seen = [], set()
    for schedule in schedules:
        for lab, (op, d) in legend_entries(schedule):
            if (op, d) not in seen:
                seen.add((op, d))
                handles.append(Patch(facecolor=COLORS[(op, d)], edgecolor="white", label=lab, **_hatch_kwargs(d, op)))
    for lab, kind in legend_marks(schedules, fake):
        handles.append(Patch(facecolor="white", edgecolor="#111111", linewidth=1.8, label=lab) if kind == "fused"
                       else Patch(facecolor=FAKE, edgecolor="none", label=lab))
    return handles


def png_figure(schedule, result: SimResult, fake: Fake = None):
    """The figure :func:`to_png` saves: a large schedule cut to its ends (:func:`.draw.frame`),
    legend and labels inside it at any size."""
    fr = frame(schedule, result)
    unit_in = UNIT_PX / 106.0  # inches per average unit (0.255: 0.17 per time unit at f=1, b=2)
    width = max(8.0, min(60.0, 1.0 + fr.width / max(fr.avg_unit, 1e-12) * unit_in))
    fig, ax = agg_pyplot().subplots(figsize=(width, 1.8 + 0.36 * len(fr.rows) + 0.5), dpi=DPI)
    points_per_time = (width - 1.2) * 72 / max(fr.width, 1e-12)
    _paint(ax, schedule, result, fr, points_per_time, fake)
    ax.set_xlim(0, fr.width)
    placed = ticks(fr, ticks_that_fit(fr, points_per_time))
    ax.set_xticks([x for x, _ in placed])
    ax.set_xticklabels([num(t) for _, t in placed])
    ax.set_xlabel("simulated time")
    sub = "\n".join(x for x in (key(schedule), fr.note) if x)
    ax.set_title(title(schedule, result) + ("\n" + sub if sub else ""), fontsize=11, loc="left")
    legend_below(fig, _legend_handles([schedule], fake is not None))
    return fig


def to_png(schedule, result: SimResult, path, fake: Fake = None) -> None:
    """Render the timeline with matplotlib (Agg backend) to ``path``."""
    save_png(png_figure(schedule, result, fake), path)


def panels_figure(panels: Sequence[Tuple[str, object, SimResult]], shared_axis: bool, time_label: str = "ms"):
    """Timelines one above the other, each labelled with its heading; on one shared time axis
    (``shared_axis``: lengths compare) or each on its own (details readable). Micro-batch labels
    are sized to their cells (:data:`LABEL_SIZES`); legend and labels stay inside the figure."""
    spans = [max(r.makespan, 1e-9) for _, _, r in panels]
    heights = [1.0 + 0.36 * s.pp for _, s, _ in panels]
    fig, axes = agg_pyplot().subplots(len(panels), 1, figsize=(STACKED_WIDTH, sum(heights)), dpi=DPI,
                                      sharex=shared_axis, squeeze=False, gridspec_kw={"height_ratios": heights})
    axes_points = (STACKED_WIDTH - 1.4) * 72  # drawing width left of the rank labels, in points
    ratio = max(spans) / min(spans)  # panels on their own time axes whose lengths differ carry a note
    note = "" if shared_axis or ratio < 1.2 else \
        f"each panel has its own time axis, fitted to it: the longest is {ratio:.1f}x the shortest"
    for i, (ax, (heading, schedule, result)) in enumerate(zip(axes[:, 0], panels)):
        span = max(spans) if shared_axis else spans[i]
        _paint(ax, schedule, result, whole(schedule, result), points_per_time=axes_points / span)
        ax.set_xlim(0, span)
        ax.set_title(heading + (f"\n({note})" if note and i == 0 else ""), fontsize=10, loc="left")
        if not shared_axis:
            ax.set_xlabel(time_label, fontsize=8)
    axes[-1, 0].set_xlabel(time_label)
    legend_below(fig, _legend_handles([s for _, s, _ in panels], fake=False))
    return fig


def stacked_figure(schedule, panels: Sequence[Tuple[str, SimResult]]):
    """``panels`` ((title, timeline) pairs over one schedule: a measured run and its simulation)
    one above the other, each on its own time axis: a measured iteration on a busy machine can
    take many times its simulation, which on a shared axis would shrink to a strip."""
    return panels_figure([(h, schedule, r) for h, r in panels], shared_axis=False)

"""Draw a simulated schedule the way DeepSeek's DualPipe figure does.

One row per pipeline rank, one cell per action placed at its simulated start and end times
and labelled with its micro-batch number. Colours tell the op (F, B, BW, W) and, within an
op, the direction: direction 0 in a strong shade, direction 1 in a light shade of the same
hue. A fused F&B unit (an F with ``overlap=True`` and the backward after it, which the
simulator runs as one unit) is one cell split in two halves, outlined with a thick border.

:func:`to_svg` is written by hand and needs nothing; :func:`to_png` imports matplotlib only
when called.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

from .schedule.actions import B, BW, F, W, Action
from .schedule.simulate import SimResult

#: Fill colour per (op, dir); direction 0 strong, direction 1 light.
COLORS: Dict[Tuple[str, int], str] = {
    (F, 0): "#f28e2b", (F, 1): "#ffcc8f",
    (BW, 0): "#3f9e4d", (BW, 1): "#a9dc9f",
    (B, 0): "#3c78b5", (B, 1): "#a7c8ec",
    (W, 0): "#8e5aa8", (W, 1): "#d7bde6",
}
#: Text colour per direction (white reads better on the strong shades).
TEXT = {0: "#ffffff", 1: "#222222"}
OP_NAMES = {F: "forward", B: "input backward", BW: "full backward", W: "weight backward"}

# Geometry (pixels) for the SVG; the PNG uses the same proportions in inches.
_UNIT = 18.0      # width of one unit of simulated time
_ROW = 24.0       # row height
_GAP = 4.0        # vertical gap between rows
_LEFT = 64.0      # room for the rank labels
_TOP = 48.0       # room for the title
_CHAR_PX = 7.0    # widest average character width of the 11 px legend font


def title(schedule, result: SimResult) -> str:
    bub = result.bubble
    return (f"{schedule.name}  pp={schedule.pp}  M={schedule.microbatches}  "
            f"makespan={_num(result.makespan)}  bubble max={_num(max(bub))} min={_num(min(bub))}")


def _num(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")


class _Cell:
    """One drawn action: its rank, index, time span and the part of the span it fills."""

    __slots__ = ("rank", "index", "action", "start", "end", "fused", "half")

    def __init__(self, rank, index, action, start, end, fused, half):
        self.rank, self.index, self.action = rank, index, action
        self.start, self.end, self.fused, self.half = start, end, fused, half

    @property
    def span(self) -> Tuple[float, float]:
        """The drawn time span: a fused unit's F takes the first half, its backward the second."""
        if not self.fused:
            return self.start, self.end
        mid = (self.start + self.end) / 2
        return (self.start, mid) if self.half == 0 else (mid, self.end)


def cells(schedule, result: SimResult) -> Iterator[_Cell]:
    """Every action of every rank with its simulated span, fused halves marked."""
    for r, acts in enumerate(schedule.ranks):
        tl = result.ranks[r]
        i = 0
        while i < len(acts):
            a = acts[i]
            if a.overlap and i + 1 < len(acts):
                yield _Cell(r, i, a, tl.starts[i], tl.ends[i], True, 0)
                yield _Cell(r, i + 1, acts[i + 1], tl.starts[i + 1], tl.ends[i + 1], True, 1)
                i += 2
            else:
                yield _Cell(r, i, a, tl.starts[i], tl.ends[i], False, 0)
                i += 1


def legend_entries(schedule) -> List[Tuple[str, str]]:
    """(label, colour) for the op/direction pairs the schedule uses, in a fixed order."""
    used = {(a.op, a.dir) for acts in schedule.ranks for a in acts}
    multi = len({d for _, d in used}) > 1
    kind = getattr(schedule.layout, "kind", "")
    where = {0: "dir 0", 1: "dir 1"}
    if kind == "bidirectional":
        where = {0: "dir 0 (from rank 0)", 1: f"dir 1 (from rank {schedule.pp - 1})"}
    elif kind == "v":
        where = {0: "chunk 0 (down)", 1: "chunk 1 (up)"}
    out = []
    for op in (F, BW, B, W):
        for d in (0, 1):
            if (op, d) in used:
                out.append((f"{op} {OP_NAMES[op]}" + (f", {where[d]}" if multi else ""), COLORS[(op, d)]))
    return out


def _label(a: Action) -> str:
    return str(a.mb)


# ---------------------------------------------------------------------------------------------
# SVG
# ---------------------------------------------------------------------------------------------

def to_svg(schedule, result: SimResult) -> str:
    """The timeline as a standalone SVG document (one ``<rect class="action">`` per action)."""
    pp = schedule.pp
    span = max(result.makespan, 1e-9)
    width = _LEFT + span * _UNIT + 20
    rows_h = pp * (_ROW + _GAP)
    entries = legend_entries(schedule) + [("fused F&B unit", "")]
    legend_top = _TOP + rows_h + 36
    per_line = min(4, len(entries))
    column = _legend_column_width(label for label, _ in entries)
    legend_h = ((len(entries) + per_line - 1) // per_line) * 20 + 24
    height = legend_top + legend_h
    width = max(width, column * per_line + _LEFT)
    font = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\""
    out: List[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.1f} {height:.1f}">',
        f'<rect class="background" x="0" y="0" width="{width:.1f}" height="{height:.1f}" fill="#ffffff"/>',
        f'<text x="{_LEFT:.1f}" y="22" font-size="15" font-weight="bold" {font}>{escape(title(schedule, result))}</text>',
    ]
    # Time axis: a light grid line and tick label every few units.
    step = _tick_step(span)
    t = 0.0
    while t <= span + 1e-9:
        x = _LEFT + t * _UNIT
        out.append(f'<line x1="{x:.1f}" y1="{_TOP - 4:.1f}" x2="{x:.1f}" y2="{_TOP + rows_h:.1f}" '
                   f'stroke="#e4e4e4" stroke-width="1"/>')
        out.append(f'<text x="{x:.1f}" y="{_TOP + rows_h + 14:.1f}" font-size="10" text-anchor="middle" '
                   f'fill="#666666" {font}>{_num(t)}</text>')
        t += step
    for r in range(pp):
        y = _TOP + r * (_ROW + _GAP)
        out.append(f'<text x="{_LEFT - 8:.1f}" y="{y + _ROW / 2 + 4:.1f}" font-size="12" text-anchor="end" '
                   f'{font}>rank {r}</text>')
    fused_outlines: List[str] = []
    for c in cells(schedule, result):
        a = c.action
        x0, x1 = c.span
        y = _TOP + c.rank * (_ROW + _GAP)
        x, w = _LEFT + x0 * _UNIT, max((x1 - x0) * _UNIT, 0.5)
        tip = f"rank {c.rank} #{c.index}: {a} stage {a.stage} [{_num(c.start)}, {_num(c.end)})"
        out.append(
            f'<rect class="action" data-rank="{c.rank}" data-index="{c.index}" data-op="{a.op}" '
            f'data-dir="{a.dir}" data-mb="{a.mb}" data-stage="{a.stage}" x="{x:.2f}" y="{y:.2f}" '
            f'width="{w:.2f}" height="{_ROW:.2f}" fill="{COLORS[(a.op, a.dir)]}" stroke="#ffffff" '
            f'stroke-width="0.8"><title>{escape(tip)}</title></rect>')
        size = 11 if w >= 16 else 9
        out.append(f'<text x="{x + w / 2:.2f}" y="{y + _ROW / 2 + 4:.2f}" font-size="{size}" '
                   f'text-anchor="middle" fill="{TEXT[a.dir]}" {font}>{_label(a)}</text>')
        if c.fused and c.half == 0:
            fx, fw = _LEFT + c.start * _UNIT, (c.end - c.start) * _UNIT
            fused_outlines.append(
                f'<path class="fused" d="M{fx + 1:.2f},{y + 1:.2f} h{fw - 2:.2f} v{_ROW - 2:.2f} '
                f'h{-(fw - 2):.2f} Z" fill="none" stroke="#111111" stroke-width="2.2"/>')
    out.extend(fused_outlines)  # on top of every cell, so neighbours cannot hide them
    # Legend.
    for k, (label, colour) in enumerate(entries):
        lx = _LEFT + (k % per_line) * column
        ly = legend_top + (k // per_line) * 20
        if colour:
            out.append(f'<rect class="legend" x="{lx:.1f}" y="{ly:.1f}" width="16" height="12" '
                       f'fill="{colour}"/>')
        else:
            out.append(f'<path class="legend" d="M{lx + 1:.1f},{ly + 1:.1f} h14 v10 h-14 Z" fill="none" '
                       f'stroke="#111111" stroke-width="2.2"/>')
        out.append(f'<text class="legend" x="{lx + 22:.1f}" y="{ly + 10:.1f}" font-size="11" {font}>{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _legend_column_width(labels) -> float:
    """Pixels for one legend column: the swatch, and the longest label at 11 px (at most
    :data:`_CHAR_PX` per character, a bound for DejaVu Sans and Helvetica)."""
    return 22 + _CHAR_PX * max(len(label) for label in labels) + 16


def _tick_step(span: float) -> float:
    for step in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000):
        if span / step <= 40:
            return float(step)
    return float(10 ** len(str(int(span))))


# ---------------------------------------------------------------------------------------------
# PNG
# ---------------------------------------------------------------------------------------------

def to_png(schedule, result: SimResult, path, dpi: int = 110) -> None:
    """Render the timeline with matplotlib (imported here, Agg backend) to ``path``."""
    _save(png_figure(schedule, result, dpi), path)


def png_figure(schedule, result: SimResult, dpi: int = 110):
    """The matplotlib figure :func:`to_png` saves: legend and labels inside it at any size."""
    from .plotting import agg_pyplot, legend_below

    span = max(result.makespan, 1e-9)
    width = max(8.0, min(60.0, 1.0 + span * 0.17))  # 0.17 inch per unit of simulated time
    fig, ax = agg_pyplot().subplots(figsize=(width, 1.5 + 0.36 * schedule.pp), dpi=dpi)
    _draw_timeline(ax, schedule, result, _label_size(width, span))
    ax.set_xlim(0, span)
    ax.set_xlabel("simulated time")
    ax.set_title(title(schedule, result), fontsize=11, loc="left")
    legend_below(fig, _legend_handles(schedule))
    return fig


# ---------------------------------------------------------------------------------------------
# Two timelines of one schedule, one above the other (a measured run and its simulation)
# ---------------------------------------------------------------------------------------------

def to_png_stacked(schedule, panels: Sequence[Tuple[str, SimResult]], path, time_label: str = "ms",
                   dpi: int = 110) -> None:
    """Draw ``panels`` ((title, timeline) pairs over the same schedule, e.g. a measured run and
    its simulation) one above the other on one time axis, with the colours, labels and fused
    outlines of :func:`to_png`; matplotlib is imported here."""
    _save(stacked_figure(schedule, panels, time_label, dpi), path)


def stacked_figure(schedule, panels: Sequence[Tuple[str, SimResult]], time_label: str = "ms", dpi: int = 110):
    """The figure :func:`to_png_stacked` saves: legend and labels inside it at any size."""
    from .plotting import agg_pyplot, legend_below

    span = max(max(r.makespan for _, r in panels), 1e-9)
    width = 16.0
    fig, axes = agg_pyplot().subplots(len(panels), 1, figsize=(width, len(panels) * (1.0 + 0.36 * schedule.pp)),
                                      dpi=dpi, sharex=True, squeeze=False)
    for ax, (heading, result) in zip(axes[:, 0], panels):
        _draw_timeline(ax, schedule, result, _label_size(width, span))
        ax.set_xlim(0, span)
        ax.set_title(heading, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel(time_label)
    legend_below(fig, _legend_handles(schedule))
    return fig


def _save(fig, path) -> None:
    from .plotting import agg_pyplot

    try:
        fig.savefig(path, format="png")
    finally:
        agg_pyplot().close(fig)


def _label_size(width_in: float, span: float) -> int:
    """Font size of the micro-batch numbers for the inches one unit of time gets."""
    per_unit = (width_in - 1.0) / span
    return 8 if per_unit >= 0.15 else (6 if per_unit >= 0.09 else 4)


def _legend_handles(schedule) -> list:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=col, edgecolor="white", label=lab) for lab, col in legend_entries(schedule)]
    if any(a.overlap for acts in schedule.ranks for a in acts):
        handles.append(Patch(facecolor="white", edgecolor="#111111", linewidth=1.8, label="fused F&B unit"))
    return handles


def _draw_timeline(ax, schedule, result: SimResult, label_size: int) -> None:
    """One timeline on ``ax``: a row per rank, a cell per action, thick outlines on fused units."""
    from matplotlib.patches import Rectangle

    pp = schedule.pp
    row, gap = 1.0, 0.14
    for c in cells(schedule, result):
        x0, x1 = c.span
        y = (pp - 1 - c.rank) * (row + gap)
        ax.add_patch(Rectangle((x0, y), x1 - x0, row, facecolor=COLORS[(c.action.op, c.action.dir)],
                               edgecolor="white", linewidth=0.6))
        ax.text((x0 + x1) / 2, y + row / 2, _label(c.action), ha="center", va="center", fontsize=label_size,
                color=TEXT[c.action.dir], clip_on=True)
        if c.fused and c.half == 0:
            ax.add_patch(Rectangle((c.start, y), c.end - c.start, row, facecolor="none", edgecolor="#111111",
                                   linewidth=1.8, zorder=3))
    ax.set_ylim(-gap, pp * (row + gap))
    ax.set_yticks([(pp - 1 - r) * (row + gap) + row / 2 for r in range(pp)])
    ax.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#e4e4e4", linewidth=0.6)
    ax.set_axisbelow(True)

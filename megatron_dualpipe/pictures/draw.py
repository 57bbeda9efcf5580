"""Draw a simulated schedule the way DeepSeek's DualPipe figure does: a row per rank, a cell per
action at its simulated times, labelled with its micro-batch.

The colour tells the op (Okabe-Ito, apart under the common colour-vision deficiencies); the
second direction is a light tint *and* hatched, so it reads without colour too. A fused F&B unit
is one cell in two halves with a thick outline; fake micro-batches are thin grey marks. A large
schedule is cut to :data:`MAX_ROWS` ranks and about :data:`MAX_UNITS_PER_ROW` units per rank
(a note says so), so any schedule renders in seconds. :func:`boxes` and :func:`outlines` place
what is drawn; :func:`to_svg` writes it as SVG and :mod:`.figure` paints it with matplotlib.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple
from xml.sax.saxutils import escape

from ..schedule.actions import B, BW, F, W, Action
from ..schedule.simulate import SimResult, units

#: Fill colour per (op, dir): Okabe-Ito hues; direction 1 a lighter tint of the same hue (and
#: hatched). The tints (30-60% white) keep the four ops >= 13 CIELAB units apart under normal
#: vision and the three dichromacies, and >= 18 from their own strong shade (tests/cli/test_draw.py).
COLORS: Dict[Tuple[str, int], str] = {
    (F, 0): "#e69f00", (F, 1): "#eebc4c",
    (BW, 0): "#009e73", (BW, 1): "#66c5ab",
    (B, 0): "#0072b2", (B, 1): "#4c9cc9",
    (W, 0): "#cc79a7", (W, 1): "#ebc9dc",
}
#: Directions drawn hatched (the shape tells the direction, not only the shade).
HATCHED = frozenset({1})
#: Text colour (dark text reads on every fill above, either direction).
TEXT = "#111111"
#: Fake micro-batches (padding).
FAKE = "#9a9a9a"
OP_NAMES = {F: "forward", B: "input backward", BW: "full backward", W: "weight backward"}

#: At most this many rank rows are drawn (the first and the last half of the ranks beyond it).
MAX_ROWS = 32
#: About this many units (actions, fused pairs) are drawn per row; beyond it the middle of the
#: run (the steady state, which repeats) is cut out.
MAX_UNITS_PER_ROW = 120

# Geometry (pixels) for the SVG; the PNG uses the same proportions in inches (UNIT_PX too).
UNIT_PX = 27.0   # width of an average unit of the busiest rank
_MAX_W = 6000.0   # widest drawing area
_ROW = 24.0       # row height
_GAP = 4.0        # vertical gap between rows
_LEFT = 64.0      # room for the rank labels
_TOP = 62.0       # room for the title and the key line
_CHAR_PX = 7.0    # widest average character width of the 11 px legend font


def title(schedule, result: SimResult) -> str:
    bub = result.bubble
    return (f"{schedule.name}  pp={schedule.pp}  M={schedule.microbatches}  "
            f"makespan={num(result.makespan)}  bubble max={num(max(bub))} min={num(min(bub))}")


def key(schedule) -> str:
    """The line under the title naming what the two shades mean, in the layout's words."""
    layout = schedule.layout
    if len({a.dir for acts in schedule.ranks for a in acts}) < 2:
        return ""
    return f"{layout.dir_label(0)}: solid;  {layout.dir_label(1)}: light, hatched"


def num(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")


class Cell:
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


def cells(schedule, result: SimResult) -> Iterator[Cell]:
    """Every action of every rank with its simulated span, fused halves marked."""
    for r, acts in enumerate(schedule.ranks):
        tl, second = result.ranks[r], False  # second: this action is the backward of a fused unit
        for i, a in enumerate(acts):
            first = not second and a.overlap and i + 1 < len(acts)
            yield Cell(r, i, a, tl.starts[i], tl.ends[i], first or second, int(second))
            second = first


def legend_entries(schedule) -> List[Tuple[str, Tuple[str, int]]]:
    """(label, (op, dir)) for the op/direction pairs the schedule uses, in the legend's order."""
    used = {(a.op, a.dir) for acts in schedule.ranks for a in acts}
    keys = [(op, d) for op in (F, BW, B, W) for d in (0, 1) if (op, d) in used]
    multi = len({d for _, d in keys}) > 1
    word = schedule.layout.dir_word
    return [(f"{op} {OP_NAMES[op]}" + (f", {word} {d}" if multi else ""), (op, d)) for op, d in keys]


def legend_marks(schedules, fake: bool) -> List[Tuple[str, str]]:
    """(label, kind) of the marks drawn besides the fills: the fused units' outline, the fake mark."""
    fused = any(a.overlap for s in schedules for acts in s.ranks for a in acts)
    return [(lab, kind) for lab, kind, drawn in (("fused F&B unit", "fused", fused),
                                                 ("fake micro-batch (padding, no compute)", "fake", fake)) if drawn]


def label(a: Action) -> str:
    """A cell's text: its micro-batch number."""
    return str(a.mb)


def label_size(chars: int, width: float, sizes: Sequence[int]) -> int:
    """The largest font size (same unit as ``width``: px or points) whose label fits the cell, or 0."""
    for size in sizes:
        if chars * 0.62 * size + 2 <= width:
            return size
    return 0


# --- What part of a large schedule is drawn ---------------------------------------------------

@dataclass
class Frame:
    """The ranks and time ranges a picture shows: ``rows`` the rank of each drawn row (``None``: a
    row saying which ranks are left out); ``segments`` the time ranges drawn, ``gap`` apart (a
    cut-out steady state). :meth:`clip` maps a time span to the drawn axis."""

    rows: List[Optional[int]]
    segments: List[Tuple[float, float]]
    gap: float
    note: str
    avg_unit: float

    @property
    def width(self) -> float:
        return sum(e - s for s, e in self.segments) + self.gap * (len(self.segments) - 1)

    def row_of(self, rank: int) -> Optional[int]:
        return self.rows.index(rank) if rank in self.rows else None

    def offsets(self) -> List[float]:
        """Drawn position of each segment's start."""
        return list(accumulate((e - s + self.gap for s, e in self.segments[:-1]), initial=0.0))

    def clip(self, t0: float, t1: float) -> List[Tuple[float, float]]:
        """The drawn spans of [t0, t1]: one per segment it overlaps (zero-width spans kept)."""
        out = []
        for (s, e), off in zip(self.segments, self.offsets()):
            a, b = max(t0, s), min(t1, e)
            if a < b or (a == b and s <= t0 <= e):
                out.append((off + a - s, off + b - s))
        return out


def frame(schedule, result: SimResult) -> Frame:
    """All of a small schedule; the ends of a large one (see :data:`MAX_ROWS`, :data:`MAX_UNITS_PER_ROW`)."""
    pp, span = schedule.pp, max(result.makespan, 1e-9)
    notes = []
    if pp <= MAX_ROWS:
        rows: List[Optional[int]] = list(range(pp))
    else:
        half = MAX_ROWS // 2
        rows = list(range(half)) + [None] + list(range(pp - half, pp))
        notes.append(f"ranks {half}-{pp - half - 1} of {pp} not drawn")
    drawn = [r for r in rows if r is not None]
    per_rank = max(len(units(schedule.ranks[r])) for r in drawn)
    busiest = max(result.ranks[r].busy for r in drawn)
    avg = busiest / per_rank if busiest > 0 else span / per_rank
    segments, gap = [(0.0, span)], 0.0
    if per_rank > MAX_UNITS_PER_ROW:
        keep = span * (MAX_UNITS_PER_ROW / 2) / per_rank
        segments, gap = [(0.0, keep), (span - keep, span)], 3 * avg
        notes.append(f"time {num(keep)}-{num(span - keep)} of {num(span)} cut out (the steady state repeats; "
                     f"fewer micro-batches draw it all)")
    return Frame(rows, segments, gap, "; ".join(notes), avg)


def ticks(frame: Frame, per_segment: int) -> List[Tuple[float, float]]:
    """(drawn position, time) of the axis ticks, ``per_segment`` or fewer in each segment."""
    out = []
    for (s, e), off in zip(frame.segments, frame.offsets()):
        step = _tick_step((e - s) / per_segment)
        t = step * -(-s // step)
        while t <= e + 1e-9:
            out.append((off + t - s, t))
            t += step
    return out


def ticks_that_fit(fr: Frame, points_per_time: float, font_pt: float = 10.0) -> int:
    """Ticks per segment whose labels (the longest time's digits at ``font_pt``, a label's width
    apart at least) do not run together on the narrowest segment."""
    chars = max(len(num(e)) for _, e in fr.segments)
    label_pt = 2 * (chars * 0.62 * font_pt + 6)
    narrowest = min(e - s for s, e in fr.segments) * points_per_time
    return max(1, int(narrowest // label_pt))


def _tick_step(raw: float) -> float:
    """The smallest 1-2-5 step not below ``raw``."""
    mag = 1.0
    while mag * 10 <= raw:
        mag *= 10
    while mag > raw and mag > 1e-9:
        mag /= 10
    for m in (1, 2, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def whole(schedule, result: SimResult) -> Frame:
    """Every rank and the whole run (the timelines drawn one above the other: each schedule the
    main job and ``trace`` draw is small)."""
    span = max(result.makespan, 1e-9)
    return Frame(list(range(schedule.pp)), [(0.0, span)], 0.0, "", span / max(1, max(
        len(units(acts)) for acts in schedule.ranks)))


Fake = Optional[Callable[[Action], bool]]


class Box(NamedTuple):
    """One drawn span of an action: its cell, the row it is drawn in, its drawn span, padding or not."""

    cell: Cell
    row: int
    x0: float
    x1: float
    fake: bool


def boxes(schedule, result: SimResult, fr: Frame, fake: Fake = None) -> Iterator[Box]:
    """Every drawn span of every action in ``fr``, in rank and action order."""
    for c in cells(schedule, result):
        row = fr.row_of(c.rank)
        if row is None:
            continue
        is_fake = fake is not None and fake(c.action)
        for x0, x1 in fr.clip(*c.span):
            yield Box(c, row, x0, x1, is_fake)


def outlines(schedule, result: SimResult, fr: Frame) -> Iterator[Tuple[int, float, float]]:
    """(row, x0, x1) of every fused F&B unit's outline in ``fr``, drawn over the cells."""
    for c in cells(schedule, result):
        row = fr.row_of(c.rank)
        if row is not None and c.fused and c.half == 0:
            for x0, x1 in fr.clip(c.start, c.end):
                yield row, x0, x1


# --- SVG --------------------------------------------------------------------------------------

def _svg_patterns() -> List[str]:
    """One hatch pattern per op for the hatched direction: the light tint crossed by the strong hue."""
    return ["<defs>", *(f'<pattern id="hatch-{op}-{d}" patternUnits="userSpaceOnUse" width="6" height="6" '
                        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{COLORS[(op, d)]}"/>'
                        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{COLORS[(op, 0)]}" stroke-width="2"/></pattern>'
                        for op in (F, BW, B, W) for d in HATCHED), "</defs>"]


def _svg_fill(op: str, d: int) -> str:
    return f"url(#hatch-{op}-{d})" if d in HATCHED else COLORS[(op, d)]


def _svg_cells(schedule, result: SimResult, fr, px: float, fake: Fake, font: str) -> List[str]:
    """One ``<rect class="action">`` (and its label) per drawn action, the fused units' outlines on top."""
    out: List[str] = []
    for c, row, x0, x1, is_fake in boxes(schedule, result, fr, fake):
        a, y = c.action, _TOP + row * (_ROW + _GAP)
        x, w = _LEFT + x0 * px, max((x1 - x0) * px, 0.5)
        tip = f"rank {c.rank} #{c.index}: {a} stage {a.stage} [{num(c.start)}, {num(c.end)})" + \
            (" fake" if is_fake else "")
        fill = FAKE if is_fake else _svg_fill(a.op, a.dir)
        mark = ' data-fake="1"' if is_fake else ""
        out.append(
            f'<rect class="action" data-rank="{c.rank}" data-index="{c.index}" data-op="{a.op}" '
            f'data-dir="{a.dir}" data-mb="{a.mb}" data-stage="{a.stage}"{mark} '
            f'x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{_ROW:.2f}" fill="{fill}" stroke="#ffffff" '
            f'stroke-width="0.8"><title>{escape(tip)}</title></rect>')
        size = label_size(len(label(a)), w, (11, 9))
        if size and not is_fake:
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + _ROW / 2 + 4:.2f}" font-size="{size}" '
                       f'text-anchor="middle" fill="{TEXT}" {font}>{label(a)}</text>')
    for row, x0, x1 in outlines(schedule, result, fr):  # on top of every cell, so neighbours cannot hide them
        y, fx, fw = _TOP + row * (_ROW + _GAP), _LEFT + x0 * px, (x1 - x0) * px
        out.append(f'<path class="fused" d="M{fx + 1:.2f},{y + 1:.2f} h{fw - 2:.2f} v{_ROW - 2:.2f} '
                   f'h{-(fw - 2):.2f} Z" fill="none" stroke="#111111" stroke-width="2.2"/>')
    return out


def _svg_legend(legend, extra, per_line: int, column: float, legend_top: float, font: str) -> List[str]:
    """The legend under the timeline: the actions' colours, then the fused-unit and fake marks."""
    out: List[str] = []
    items = [(lab, _svg_fill(op, d), None) for lab, (op, d) in legend] + [(lab, FAKE, kind) for lab, kind in extra]
    for k, (label, fill, kind) in enumerate(items):
        lx = _LEFT + (k % per_line) * column
        ly = legend_top + (k // per_line) * 20
        if kind == "fused":
            out.append(f'<path class="legend" d="M{lx + 1:.1f},{ly + 1:.1f} h14 v10 h-14 Z" fill="none" '
                       f'stroke="#111111" stroke-width="2.2"/>')
        else:
            out.append(f'<rect class="legend" x="{lx:.1f}" y="{ly:.1f}" width="16" height="12" fill="{fill}"/>')
        out.append(f'<text class="legend" x="{lx + 22:.1f}" y="{ly + 10:.1f}" font-size="11" {font}>'
                   f'{escape(label)}</text>')
    return out


def to_svg(schedule, result: SimResult, fake: Fake = None) -> str:
    """The timeline as a standalone SVG document (one ``<rect class="action">`` per drawn action).

    ``fake(action)`` marks padding micro-batches (drawn as thin grey marks)."""
    fr = frame(schedule, result)
    px = min(UNIT_PX / max(fr.avg_unit, 1e-12), _MAX_W / max(fr.width, 1e-12))
    rows_h = len(fr.rows) * (_ROW + _GAP)
    legend = legend_entries(schedule)
    legend_top = _TOP + rows_h + 36
    extra = legend_marks([schedule], fake is not None)
    n_entries = len(legend) + len(extra)
    per_line = min(4, n_entries)
    # one column: the swatch, and the longest label at 11 px (at most _CHAR_PX per character, a bound for
    # DejaVu Sans and Helvetica)
    column = 22 + _CHAR_PX * max(len(lab) for lab, _ in legend + extra) + 16
    legend_h = ((n_entries + per_line - 1) // per_line) * 20 + 24
    height = legend_top + legend_h
    width = max(_LEFT + fr.width * px + 20, column * per_line + _LEFT)
    font = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\""
    out: List[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.1f} {height:.1f}">',
        *_svg_patterns(),
        f'<rect class="background" x="0" y="0" width="{width:.1f}" height="{height:.1f}" fill="#ffffff"/>',
        f'<text x="{_LEFT:.1f}" y="22" font-size="15" font-weight="bold" {font}>{escape(title(schedule, result))}</text>',
    ]
    sub = "; ".join(x for x in (key(schedule), fr.note) if x)
    if sub:
        out.append(f'<text class="note" x="{_LEFT:.1f}" y="40" font-size="11" fill="#444444" {font}>'
                   f'{escape(sub)}</text>')
    for x_t, t in ticks(fr, max(2, int(fr.width * px / 45) // len(fr.segments))):
        x = _LEFT + x_t * px
        out.append(f'<line x1="{x:.1f}" y1="{_TOP - 4:.1f}" x2="{x:.1f}" y2="{_TOP + rows_h:.1f}" '
                   f'stroke="#e4e4e4" stroke-width="1"/>')
        out.append(f'<text x="{x:.1f}" y="{_TOP + rows_h + 14:.1f}" font-size="10" text-anchor="middle" '
                   f'fill="#666666" {font}>{num(t)}</text>')
    if len(fr.segments) > 1:
        gx = _LEFT + (fr.segments[0][1] - fr.segments[0][0]) * px
        out.append(f'<rect class="cut" x="{gx:.1f}" y="{_TOP - 4:.1f}" width="{fr.gap * px:.1f}" '
                   f'height="{rows_h + 4:.1f}" fill="#f0f0f0"/>')
        out.append(f'<text x="{gx + fr.gap * px / 2:.1f}" y="{_TOP + rows_h / 2:.1f}" font-size="14" '
                   f'text-anchor="middle" fill="#666666" {font}>...</text>')
    for i, r in enumerate(fr.rows):
        y = _TOP + i * (_ROW + _GAP)
        text = f"rank {r}" if r is not None else "..."
        out.append(f'<text x="{_LEFT - 8:.1f}" y="{y + _ROW / 2 + 4:.1f}" font-size="12" text-anchor="end" '
                   f'{font}>{text}</text>')
    out += _svg_cells(schedule, result, fr, px, fake, font)
    out += _svg_legend(legend, extra, per_line, column, legend_top, font)
    out.append("</svg>")
    return "\n".join(out) + "\n"

"""Every drawing keeps its legend and labels inside the image, at any pipeline size and M.

The pp=4, M=16 timeline of the main job used to lose both ends of its legend (a 5-column legend
wider than the 9.5-inch figure). Each figure here is drawn and then measured by matplotlib's
renderer: the legend's window extent, every drawn title, axis label and tick label, and the tight
box of everything drawn must lie inside the figure's canvas.
"""
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("matplotlib")

from megatron_dualpipe.pictures.draw import _CHAR_PX, to_svg  # noqa: E402
from megatron_dualpipe.pictures.figure import png_figure, stacked_figure, to_png  # noqa: E402
from megatron_dualpipe.pictures.plotting import agg_pyplot, outside_figure  # noqa: E402
from megatron_dualpipe.apps.report import RunResult, loss_figure, write_loss_png  # noqa: E402
from megatron_dualpipe.schedule import build_schedule  # noqa: E402
from megatron_dualpipe.schedule.simulate import Costs, simulate  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
CASES = [("dualpipe", 4, 16), ("1f1b", 2, 1), ("dualpipe", 2, 4), ("dualpipev", 2, 4), ("zb-h1", 3, 5),
         ("dualpipe", 8, 20), ("dualpipev", 6, 40), ("1f1b", 12, 12)]


def _inside(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.legends[0].get_window_extent(renderer)
    return box, fig.bbox


@pytest.mark.parametrize("name,pp,m", CASES, ids=[f"{n}-pp{p}-m{m}" for n, p, m in CASES])
def test_timeline_png_keeps_legend_and_labels_inside(name, pp, m):
    s = build_schedule(name, pp, m)
    fig = png_figure(s, simulate(s.layout, s.ranks, Costs()))
    try:
        legend, canvas = _inside(fig)
        print(f"\n{name} pp={pp} M={m}: figure {canvas.width:.0f}x{canvas.height:.0f} px, legend x "
              f"{legend.x0:.0f}..{legend.x1:.0f} y {legend.y0:.0f}..{legend.y1:.0f}")
        assert canvas.x0 <= legend.x0 and legend.x1 <= canvas.x1 and canvas.y0 <= legend.y0 and legend.y1 <= canvas.y1
        assert outside_figure(fig) == []
    finally:
        agg_pyplot().close(fig)


def test_svg_legend_columns_fit_the_width():
    for name, pp, m in CASES:
        s = build_schedule(name, pp, m)
        root = ET.fromstring(to_svg(s, simulate(s.layout, s.ranks, Costs())))
        ns = "{http://www.w3.org/2000/svg}"
        width, height = float(root.get("width")), float(root.get("height"))
        texts = [e for e in root.iter(ns + "text") if e.get("class") == "legend"]
        right = max(float(e.get("x")) + len(e.text) * _CHAR_PX for e in texts)
        print(f"\n{name} pp={pp} M={m}: SVG {width:.0f}x{height:.0f}, legend reaches x {right:.0f}")
        assert texts and right <= width, (name, pp, m, right, width)
        legend_ys = [float(e.get("y")) for e in root.iter(ns + "rect") if e.get("class") == "legend"]
        assert max(legend_ys) + 12 <= height


def _run(name, n, slope, noise=0.0):
    return RunResult(name, [6.9 - slope * i + noise * (i % 3) for i in range(n)], valid_loss=6.9 - slope * n,
                     seconds=1.0, tokens_per_second=1000.0)


@pytest.mark.parametrize("n,noise", [(1, 0.0), (30, 3e-7), (500, 0.02)])
def test_loss_png_keeps_legend_and_labels_inside(tmp_path, n, noise):
    a, b = _run("dualpipe", n, 0.01, noise), _run("1f1b", n, 0.01)
    fig = loss_figure(a, b, "dualpipe vs 1f1b, pp=4, 8 layers, hidden 64, 16x2x64 tokens per iteration")
    try:
        assert outside_figure(fig) == []
    finally:
        agg_pyplot().close(fig)
    path = tmp_path / "loss.png"
    write_loss_png(str(path), a, b, "title")
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_measured_over_simulated_png_keeps_legend_and_labels_inside():
    """The stacked drawing of ``megatron-dualpipe trace`` and the main job's timeline.png."""
    for name, pp, m in (("dualpipe", 4, 16), ("dualpipev", 2, 4), ("dualpipe", 8, 20)):
        s = build_schedule(name, pp, m)
        panels = [("measured", simulate(s.layout, s.ranks, Costs(f=1.2, b=2.1, w=0.9))),
                  ("simulated", simulate(s.layout, s.ranks, Costs()))]
        fig = stacked_figure(s, panels)
        try:
            assert outside_figure(fig) == [], (name, pp, m)
        finally:
            agg_pyplot().close(fig)


def test_timeline_png_is_written(tmp_path):
    s = build_schedule("dualpipe", 4, 16)
    path = tmp_path / "t.png"
    to_png(s, simulate(s.layout, s.ranks, Costs()), str(path))
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


# ---------------------------------------------------------------------------------------------
# Labels sized to their cells; each timeline on an axis that fits it; schedules compared
# ---------------------------------------------------------------------------------------------

def _labels_and_cells(fig):
    """(font size, label width, cell width) in pixels for every micro-batch label drawn."""
    from matplotlib.collections import PolyCollection

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        cells = [p.get_extents() for c in ax.collections if isinstance(c, PolyCollection)
                 and c.get_facecolor().size and c.get_facecolor()[0][3] > 0 for p in c.get_paths()]
        for t in ax.texts:
            x, y = t.get_position()
            cell = next(c for c in cells if c.x0 <= x <= c.x1 and c.y0 <= y <= c.y1)
            box = cell.transformed(ax.transData)
            found.append((t.get_fontsize(), t.get_window_extent(renderer).width, box.width))
    return found


@pytest.mark.parametrize("measured_scale", [1.1, 7.0])
def test_stacked_labels_fit_their_cells_and_each_panel_fits_its_axis(measured_scale):
    """The main job's timeline.png: the measured iteration took 7x its simulation on a busy machine.
    Each panel is drawn on its own axis, fitted to it (a note says so), and every micro-batch label
    is as large as its cell allows (5 to 8 pt) and no wider than the cell: not 4 pt everywhere."""
    s = build_schedule("dualpipe", 4, 16)
    unit = Costs()
    slow = Costs(f=unit.f * measured_scale, b=unit.b * measured_scale, w=unit.w * measured_scale)
    measured, sim = simulate(s.layout, s.ranks, slow), simulate(s.layout, s.ranks, unit)
    fig = stacked_figure(s, [("measured", measured), ("simulated", sim)])
    try:
        top, bottom = fig.axes[:2]
        print(f"\nmeasured {measured.makespan:g} on x 0..{top.get_xlim()[1]:g}, simulated {sim.makespan:g} on "
              f"x 0..{bottom.get_xlim()[1]:g}; title: {top.get_title(loc='left')!r}")
        assert top.get_xlim() == (0, measured.makespan) and bottom.get_xlim() == (0, sim.makespan)
        assert ("own time axis" in top.get_title(loc='left')) == (measured_scale > 1.2)
        labels = _labels_and_cells(fig)
        sizes = sorted({size for size, _, _ in labels})
        print(f"{len(labels)} labels, sizes {sizes}")
        assert len(labels) >= len([a for acts in s.ranks for a in acts]) and min(sizes) >= 5
        assert all(w <= cell + 1 for _, w, cell in labels)
        assert outside_figure(fig) == []
    finally:
        agg_pyplot().close(fig)


def test_narrow_cells_get_no_label_rather_than_an_unreadable_one():
    s = build_schedule("dualpipe", 8, 64)
    sim = simulate(s.layout, s.ranks, Costs())
    fig = stacked_figure(s, [("simulated", sim)])
    try:
        labels = _labels_and_cells(fig)
        print(f"\n{len(labels)} labels on {sum(len(a) for a in s.ranks)} actions, sizes {sorted({x for x, _, _ in labels})}")
        assert all(size >= 5 and w <= cell + 1 for size, w, cell in labels)
    finally:
        agg_pyplot().close(fig)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_schedule_against_1f1b_on_one_axis_with_makespans(tmp_path, name):
    """The main job's <schedule>_vs_1f1b picture: both simulated on one time axis, makespans in the
    titles, equal to the simulator's (an independent run of it here)."""
    from megatron_dualpipe.pictures.figure import panels_figure
    from megatron_dualpipe.apps.report import simulated_pair, write_schedule_comparison

    panels, makespans = simulated_pair(name, 4, 16)
    one = build_schedule("1f1b", 4, 16)
    assert makespans[1] == ("1f1b", simulate(one.layout, one.ranks, Costs()).makespan)
    fig = panels_figure(panels, shared_axis=True)
    try:
        top, bottom = fig.axes[:2]
        print(f"\n{top.get_title(loc='left')}\n{bottom.get_title(loc='left')}")
        assert top.get_xlim() == bottom.get_xlim() == (0, max(m for _, m in makespans))
        for ax, (n, m) in zip((top, bottom), makespans):
            assert ax.get_title(loc='left').startswith(f"{n}: ") and f"makespan {m:g}" in ax.get_title(loc='left')
        assert outside_figure(fig) == []
    finally:
        agg_pyplot().close(fig)
    path = write_schedule_comparison(str(tmp_path), name, 4, 16)
    assert open(path, "rb").read(8) == PNG


# ---------------------------------------------------------------------------------------------
# The pictures committed under docs/ are drawn with the current palette
# ---------------------------------------------------------------------------------------------

DOCS = __import__("pathlib").Path(__file__).resolve().parents[2] / "docs"
#: Timeline pictures in docs/ and the command that regenerates each (also written beside them in the docs).
DOC_TIMELINES = {
    "dualpipe_pp8_m20.png": "megatron-dualpipe simulate --schedule dualpipe --pp 8 --microbatches 20 --fb 3 "
                            "--png docs/dualpipe_pp8_m20.png --svg docs/dualpipe_pp8_m20.svg",
    "trace_dualpipe_pp4_bench.png": "megatron-dualpipe bench --pp 4 -m 8 --schedule dualpipe --trace DIR; megatron-dualpipe trace DIR/dualpipe_pp4_m8 --png docs/trace_dualpipe_pp4_bench.png",
    "run/timeline.png": "bash scripts/run_main.sh --out docs/run",
    "run/dualpipe_pp4_m16.png": "bash scripts/run_main.sh --out docs/run",
    "run/dualpipe_vs_1f1b_pp4_m16.png": "bash scripts/run_main.sh --out docs/run",
}


def _pixels_near(img, colour: str, tolerance: int = 3) -> int:
    import numpy as np

    rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(img - rgb).max(axis=-1) <= tolerance).sum())


@pytest.mark.parametrize("name", sorted(DOC_TIMELINES))
def test_docs_timelines_use_the_current_palette(name):
    """Every op drawn in a committed timeline has the current palette's colour (draw.COLORS), and
    none has another colour in its place: a picture left from an older palette fails here, naming
    the command that regenerates it. The fills of direction 0 are counted pixel by pixel."""
    import numpy as np
    from matplotlib.image import imread

    from megatron_dualpipe.pictures.draw import COLORS
    from megatron_dualpipe.schedule.actions import B, BW, F

    path = DOCS / name
    assert path.is_file(), f"docs/{name} is missing: {DOC_TIMELINES[name]}"
    img = (imread(str(path))[..., :3] * 255).round().astype(int)
    counts = {f"{op}{d}": _pixels_near(img, c) for (op, d), c in COLORS.items()}
    print(f"\ndocs/{name}: {counts}")
    assert counts[f"{F}0"] > 500 and max(counts[f"{B}0"], counts[f"{BW}0"]) > 500, \
        f"docs/{name} is not drawn with the current palette: regenerate it with {DOC_TIMELINES[name]}"
    # No large area of a saturated colour outside the palette (an older palette's fills).
    sat = (img.max(axis=-1) - img.min(axis=-1)) > 60
    palette = np.zeros(sat.shape, bool)
    for c in COLORS.values():
        rgb = np.array([int(c[i:i + 2], 16) for i in (1, 3, 5)])
        palette |= np.abs(img - rgb).max(axis=-1) <= 24  # antialiased edges and hatching blend nearby
    stray = int((sat & ~palette).sum())
    print(f"saturated pixels outside the palette: {stray} of {int(sat.sum())}")
    assert stray < 0.05 * sat.sum(), f"docs/{name} has colours outside the palette: {DOC_TIMELINES[name]}"


@pytest.mark.parametrize("name,pp,m", [("1f1b", 64, 256), ("dualpipe", 64, 256), ("dualpipe", 8, 20)])
def test_time_axis_tick_labels_do_not_run_together(name, pp, m):
    """simulate --pp 64 -m 256 --png ran its x tick labels together (4 per inch, whatever their
    digits): between two labels at least two characters' width of space."""
    s = build_schedule(name, pp, m)
    fig = png_figure(s, simulate(s.layout, s.ranks, Costs()))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        labels = [t for t in ax.get_xticklabels() if t.get_text()]
        boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
        char = max(t.get_window_extent(renderer).width / len(t.get_text()) for t in labels)
        gaps = [b.x0 - a.x1 for a, b in zip(boxes, boxes[1:])]
        print(f"\n{name} pp={pp} M={m}: {len(boxes)} labels ({', '.join(t.get_text() for t in labels)}), smallest "
              f"gap {min(gaps):.1f} px, a character {char:.1f} px")
        assert len(boxes) >= 2 and min(gaps) >= 2 * char
    finally:
        agg_pyplot().close(fig)

"""Every drawing keeps its legend and labels inside the image, at any pipeline size and M.

The pp=4, M=16 timeline of the main job used to lose both ends of its legend (a 5-column legend
wider than the 9.5-inch figure). Each figure here is drawn and then measured by matplotlib's
renderer: the legend's window extent, every drawn title, axis label and tick label, and the tight
box of everything drawn must lie inside the figure's canvas.
"""
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("matplotlib")

from megatron_dualpipe.draw import _CHAR_PX, png_figure, stacked_figure, to_png, to_svg  # noqa: E402
from megatron_dualpipe.plotting import agg_pyplot, outside_figure  # noqa: E402
from megatron_dualpipe.report import RunResult, loss_figure, write_loss_png  # noqa: E402
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

"""The drawing: a colour-blind-safe palette with hatching for direction 1, one word per ``dir``,
fake micro-batches marked, and pictures bounded in size for every schedule the CLI accepts."""
import functools
import math
import xml.etree.ElementTree as ET

import pytest

from megatron_dualpipe.cli.build import MAX_FORWARDS
from megatron_dualpipe.pictures import draw, figure
from megatron_dualpipe.schedule import build_schedule, registry
from megatron_dualpipe.schedule.actions import OPS
from megatron_dualpipe.schedule.padding import build_padded
from megatron_dualpipe.schedule.registry import DUALPIPE, DUALPIPEV, ONE_F_ONE_B, ZB_H1
from megatron_dualpipe.schedule.simulate import Costs, simulate

NS = "{http://www.w3.org/2000/svg}"

# Machado, Oliveira & Fernandes (2009) colour-vision-deficiency matrices, severity 1, on linear RGB.
CVD = {
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216), (-0.003882, -0.048116, 1.051998)),
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413), (-0.011820, 0.042940, 0.968881)),
    "tritanopia": ((1.255528, -0.076749, -0.178779), (-0.078411, 0.930809, 0.147602), (0.004733, 0.691367, 0.303900)),
}


def _linear(hex_colour):
    c = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return [x / 12.92 if x <= 0.04045 else ((x + 0.055) / 1.055) ** 2.4 for x in c]


def _lab(rgb):
    rgb = [min(1.0, max(0.0, x)) for x in rgb]
    m = ((0.4124, 0.3576, 0.1805), (0.2126, 0.7152, 0.0722), (0.0193, 0.1192, 0.9505))
    x, y, z = (sum(m[i][j] * rgb[j] for j in range(3)) for i in range(3))
    x, z = x / 0.95047, z / 1.08883

    def f(t):
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def _seen(hex_colour, vision):
    rgb = _linear(hex_colour)
    if vision != "normal":
        rgb = [sum(CVD[vision][i][j] * rgb[j] for j in range(3)) for i in range(3)]
    return _lab(rgb)


def _min_distance(colours, vision):
    labs = [_seen(c, vision) for c in colours]
    return min(math.dist(a, b) for i, a in enumerate(labs) for b in labs[i + 1:])


def test_palette_keeps_ops_apart_for_colour_blind_readers():
    """Within each direction the four op colours stay >= 10 CIELAB units (CIE76) apart under normal vision and
    the three dichromacies (Machado 2009); the old palette's light shades fell to 1.8 for protanopes."""
    old = {(0, "F"): "#f28e2b", (1, "F"): "#ffcc8f", (0, "BW"): "#3f9e4d", (1, "BW"): "#a9dc9f",
           (0, "B"): "#3c78b5", (1, "B"): "#a7c8ec", (0, "W"): "#8e5aa8", (1, "W"): "#d7bde6"}
    for vision in ("normal", *CVD):
        for d in (0, 1):
            new = _min_distance([draw.COLORS[(op, d)] for op in OPS], vision)
            before = _min_distance([old[(d, op)] for op in OPS], vision)
            print(f"\n{vision:>12} direction {d}: closest op colours {new:5.1f} apart (old palette {before:5.1f})")
            assert new >= 10, (vision, d, new)
        for op in OPS:  # a direction's tint stays apart from its strong shade too (besides the hatching)
            assert math.dist(_seen(draw.COLORS[(op, 0)], vision), _seen(draw.COLORS[(op, 1)], vision)) >= 8


def test_direction_one_is_hatched_not_only_lighter():
    s = build_schedule(DUALPIPE, 4, 8)
    root = ET.fromstring(draw.to_svg(s, simulate(s.layout, s.ranks, Costs())))
    patterns = {p.get("id") for p in root.iter(NS + "pattern")}
    for e in root.iter(NS + "rect"):
        if e.get("class") == "action":
            hatched = e.get("fill").startswith("url(#hatch-")
            assert hatched == (int(e.get("data-dir")) in draw.HATCHED)
            if hatched:
                assert e.get("fill")[5:-1] in patterns


@pytest.mark.parametrize("name,words", [(DUALPIPE, ("direction 0 (enters at rank 0)", "direction 1 (enters at rank 3)")),
                                        (DUALPIPEV, ("chunk 0 (stages 0-3, down the ranks)",
                                                     "chunk 1 (stages 4-7, back up)"))])
def test_one_word_for_dir_in_pictures(name, words):
    s = build_schedule(name, 4, 8)
    svg = draw.to_svg(s, simulate(s.layout, s.ranks, Costs()))
    for w in words:
        assert w in svg
    other = "direction" if name == DUALPIPEV else "chunk"
    assert f"{other} 0" not in svg and f"{other} 1" not in svg
    assert "dir 0" not in svg


def test_fake_microbatches_are_marked():
    padded = build_padded(DUALPIPE, 4, 5)
    s = padded.schedule
    res = simulate(s.layout, s.ranks, padded.costs(Costs()))
    root = ET.fromstring(draw.to_svg(s, res, fake=padded.is_fake))
    fakes = [e for e in root.iter(NS + "rect") if e.get("data-fake") == "1"]
    want = sum(padded.is_fake(a) for acts in s.ranks for a in acts)
    print(f"\ndualpipe pp=4: 5 real micro-batches run as {s.microbatches}; {want} fake actions drawn grey")
    assert len(fakes) == want > 0 and all(e.get("fill") == draw.FAKE for e in fakes)


#: The largest schedules the command line accepts (MAX_FORWARDS forward actions): the most ranks and
#: units at once, and the longest rows.
AT_THE_LIMIT = [(DUALPIPE, 8, 8192), (DUALPIPE, 64, 1024)]
#: Each other shape, still well past both bounds where it has them (ranks past MAX_ROWS, actions per
#: rank past 2 * MAX_UNITS_PER_ROW): the window is cut the same way at any size, and simulating
#: these at the limit took most of this file's time. The last case is the one the PNG test draws.
LARGE = [(ONE_F_ONE_B, 64, 256), (ZB_H1, 64, 256), (DUALPIPEV, 32, 256), (ONE_F_ONE_B, 256, 32)] + AT_THE_LIMIT


@functools.lru_cache(maxsize=1)
def _simulated(name, pp, m):
    """The schedule and its unit-cost simulation; the last one kept (the PNG test draws LARGE's last)."""
    s = build_schedule(name, pp, m)
    return s, simulate(s.layout, s.ranks, Costs())


def test_the_limit_cases_are_at_the_command_lines_limit():
    for name, pp, m in AT_THE_LIMIT:
        assert registry.get(name).model_stages(pp) * m == MAX_FORWARDS, (name, pp, m)


@pytest.mark.parametrize("name,pp,m", LARGE)
def test_large_schedules_draw_a_bounded_window_with_a_note(name, pp, m):
    s, res = _simulated(name, pp, m)
    svg = draw.to_svg(s, res)
    root = ET.fromstring(svg)
    cells = [e for e in root.iter(NS + "rect") if e.get("class") == "action"]
    ranks = {int(e.get("data-rank")) for e in cells}
    note = "".join(e.text or "" for e in root.iter(NS + "text") if e.get("class") == "note")
    total = sum(len(r) for r in s.ranks)
    print(f"\n{name} pp={pp} M={m}: {total} actions, {len(cells)} drawn on {len(ranks)} ranks, SVG "
          f"{len(svg) / 1e6:.2f} MB; {note}")
    assert len(ranks) <= draw.MAX_ROWS and len(svg) < 4_000_000
    assert len(cells) <= draw.MAX_ROWS * 3 * draw.MAX_UNITS_PER_ROW
    longest = max(len(r) for r in s.ranks)
    assert pp > draw.MAX_ROWS or longest > 2 * draw.MAX_UNITS_PER_ROW  # a case that a bound cuts
    if pp > draw.MAX_ROWS:
        assert ranks == set(range(16)) | set(range(pp - 16, pp)) and "not drawn" in note
    if longest > 2 * draw.MAX_UNITS_PER_ROW:
        assert "cut out" in note and "steady state" in note


def test_small_schedules_are_drawn_whole():
    s = build_schedule(DUALPIPEV, 4, 10)
    fr = draw.frame(s, simulate(s.layout, s.ranks, Costs()))
    assert fr.rows == [0, 1, 2, 3] and len(fr.segments) == 1 and fr.note == ""


def test_large_png_renders(tmp_path):
    pytest.importorskip("matplotlib")
    s, res = _simulated(*LARGE[-1])
    path = tmp_path / "big.png"
    figure.to_png(s, res, path)
    print(f"\n{s.name} pp={s.pp} M={s.microbatches} PNG: {path.stat().st_size / 1e6:.2f} MB")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size < 4_000_000

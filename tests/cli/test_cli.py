"""The ``megatron-dualpipe`` command line, run in-process (plus one ``python -m`` check)."""
import json
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from megatron_dualpipe.cli import COMMANDS, main
from megatron_dualpipe.schedule import build_schedule
from megatron_dualpipe.schedule.actions import Action

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_schedule_json_shape(capsys):
    code, out, err = run(capsys, "schedule", "--schedule", "dualpipe", "--pp", "4", "--microbatches", "8", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert set(doc) == {"schedule", "pp", "microbatches", "ranks"}
    assert (doc["schedule"], doc["pp"], doc["microbatches"]) == ("dualpipe", 4, 8)
    assert len(doc["ranks"]) == 4
    seen_overlap = False
    for acts in doc["ranks"]:
        for a in acts:
            if "overlap" in a:
                assert a["overlap"] is True and a["op"] == "F"
                seen_overlap = True
                assert set(a) == {"op", "dir", "mb", "stage", "overlap"}
            else:
                assert set(a) == {"op", "dir", "mb", "stage"}
    assert seen_overlap
    # Round trip: the JSON is the schedule.
    s = build_schedule("dualpipe", 4, 8)
    assert tuple(tuple(Action.from_json(a) for a in acts) for acts in doc["ranks"]) == s.ranks


@pytest.mark.parametrize("name,pp,m", [("1f1b", 3, 5), ("zb-h1", 4, 6), ("dualpipev", 2, 5)])
def test_schedule_json_round_trip(capsys, name, pp, m):
    code, out, _ = run(capsys, "schedule", "--schedule", name, "--pp", str(pp), "--microbatches", str(m), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc == build_schedule(name, pp, m).to_json()
    assert [[Action.from_json(a) for a in acts] for acts in doc["ranks"]] == [list(r) for r in build_schedule(name, pp, m).ranks]


def test_schedule_text_grid(capsys):
    code, out, err = run(capsys, "schedule", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "3")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("zb-h1: pp=2 M=3")
    assert "rank  0: F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 W0.1 B0.2 W0.2" in lines
    assert "rank  1: F0.0 B0.0 F0.1 B0.1 W0.0 F0.2 B0.2 W0.1 W0.2" in lines


def test_simulate_json(capsys):
    code, out, err = run(capsys, "simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert {"makespan", "bubble", "peak_activations", "busy", "same_model"} <= set(doc)
    assert (doc["schedule"], doc["pp"], doc["microbatches"], doc["real_microbatches"]) == ("1f1b", 4, 8, 8)
    assert doc["bubble"] == [9.0] * 4  # (pp-1)(f+b)
    assert doc["peak_activations"] == [4, 3, 2, 1]
    assert doc["busy"] == [24.0] * 4
    assert doc["makespan"] == 33.0


def test_simulate_costs_and_text(capsys):
    code, out, _ = run(capsys, "simulate", "--schedule", "dualpipe", "--pp", "8", "--microbatches", "16",
                       "--f", "1", "--b", "2", "--w", "1", "--fb", "3")
    assert code == 0
    assert "makespan" in out and "peak activations" in out
    assert "(pp/2-1)(fb+b-3w)" in out and "(pp-1)(f+b-2w)" in out and "(pp-1)(f+b)" in out
    assert "dualpipe: simulated bubble - closed form = 0" in out
    code, out2, _ = run(capsys, "simulate", "--schedule", "dualpipe", "--pp", "8", "--microbatches", "16",
                        "--p2p", "0.25", "--json")
    assert json.loads(out2)["makespan"] > 0


def test_simulate_draws_png_and_svg(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    code, out, err = run(capsys, "simulate", "--schedule", "dualpipe", "--pp", "4", "--microbatches", "8",
                         "--png", str(png), "--svg", str(svg))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == ns + "svg"
    s = build_schedule("dualpipe", 4, 8)
    cells = [e for e in root.iter(ns + "rect") if e.get("class") == "action"]
    assert len(cells) == sum(len(r) for r in s.ranks)
    # Each cell is its action; fused units are outlined once each.
    got = sorted((int(e.get("data-rank")), int(e.get("data-index"))) for e in cells)
    assert got == sorted((r, i) for r, acts in enumerate(s.ranks) for i in range(len(acts)))
    fused = [e for e in root.iter(ns + "path") if e.get("class") == "fused"]
    assert len(fused) == sum(a.overlap for acts in s.ranks for a in acts)
    labels = "".join(t.text or "" for t in root.iter(ns + "text"))
    assert "dualpipe" in labels and "makespan" in labels and "bubble" in labels


def test_svg_has_one_rect_per_action_for_every_schedule(tmp_path):
    from megatron_dualpipe.pictures.draw import to_svg
    from megatron_dualpipe.schedule.simulate import Costs, simulate

    for name, pp, m in (("1f1b", 4, 6), ("zb-h1", 3, 5), ("dualpipev", 3, 7)):
        s = build_schedule(name, pp, m)
        root = ET.fromstring(to_svg(s, simulate(s.layout, s.ranks, Costs())))
        n = sum(1 for e in root.iter("{http://www.w3.org/2000/svg}rect") if e.get("class") == "action")
        assert n == sum(len(r) for r in s.ranks)


BAD = [
    (["schedule", "--schedule", "nope", "--pp", "4", "--microbatches", "8"], "unknown schedule"),
    (["schedule", "--schedule", "dualpipe", "--pp", "3", "--microbatches", "8"], "--pp to 4"),
    (["schedule", "--schedule", "dualpipe", "--pp", "4", "--microbatches", "6", "--no-pad"], "use 8"),
    (["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "7", "--no-pad"], "use 8"),
    (["schedule", "--schedule", "dualpipe", "--pp", "4", "--microbatches", "3"], "at least 4"),
    (["schedule", "--schedule", "1f1b", "--pp", "0", "--microbatches", "8"], "pipeline size"),
    (["schedule", "--schedule", "1f1b", "--pp", "4", "--microbatches", "0"], "micro-batches"),
    (["schedule", "--schedule", "1f1b", "--pp", "four", "--microbatches", "8"], "--pp"),
    (["schedule", "--schedule", "1f1b", "--pp", "4"], "--microbatches"),
    (["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--f", "-1"], "--f"),
    (["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--p2p", "-1"], "--p2p"),
    (["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--w", "3"], "cannot exceed"),
    (["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--b", "nan"], "finite"),
    (["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--png", "/no/such/dir/x.png"],
     "cannot write"),
    (["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--svg", "/no/such/dir/x.svg"],
     "cannot write"),
    (["bogus"], "invalid choice"),
    ([], "choose a command"),
    (["schedule", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--what"], "unrecognized"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) or "<none>" for a, _ in BAD])
def test_bad_arguments_give_one_line_errors(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("megatron-dualpipe: error: "), err
    assert needle in err


def test_output_path_is_a_directory(capsys, tmp_path):
    code, _, err = run(capsys, "simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2",
                       "--svg", str(tmp_path))
    assert code == 2 and err.startswith("megatron-dualpipe: error: cannot write") and err.count("\n") == 1


def test_subcommands_are_registered_in_one_place():
    assert {"schedule", "simulate"} <= set(COMMANDS)


def test_python_dash_m(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "megatron_dualpipe", "schedule", "--schedule", "dualpipev",
                        "--pp", "2", "--microbatches", "4", "--json"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == build_schedule("dualpipev", 2, 4).to_json()
    p = subprocess.run([sys.executable, "-m", "megatron_dualpipe", "schedule", "--schedule", "dualpipe",
                        "--pp", "3", "--microbatches", "8"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    assert p.returncode == 2
    assert p.stderr.startswith("megatron-dualpipe: error: ") and p.stderr.count("\n") == 1


def test_cpu_mode_lists_every_redirection(capsys):
    from megatron_dualpipe import cpu

    code, out, err = run(capsys, "cpu-mode", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    listed = [(r["part"], r["target"]) for r in doc["redirections"]]
    want = [(part, r.target) for part in cpu.PARTS for r in cpu.redirections(part)]
    print(f"\ncpu-mode lists {len(listed)} redirections: "
          + ", ".join(f"{p}: {sum(1 for q, _ in listed if q == p)}" for p in cpu.PARTS))
    assert listed == want and all(r["why"] for r in doc["redirections"])
    code, out, _ = run(capsys, "cpu-mode")
    assert code == 0 and all(target in out for _, target in want)


@pytest.mark.parametrize("name", __import__("megatron_dualpipe.schedule.registry", fromlist=["NAMES"]).NAMES)
def test_simulate_compares_every_schedule_with_this_one_marked(capsys, name):
    code, out, err = run(capsys, "simulate", "--schedule", name, "--pp", "4", "--microbatches", "8")
    assert code == 0, err
    marked = [line for line in out.splitlines() if line.endswith("<- this schedule")]
    assert len(marked) == 1 and marked[0].split()[0] == name

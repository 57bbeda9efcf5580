"""Our DualPipe / DualPipeV generators produce exactly DeepSeek's per-rank order.

``tests/data/reference_schedules.json`` was produced by ``tools/trace_reference.py``, which
runs the reference's own ``step()`` (github.com/deepseek-ai/DualPipe) with its compute and
communication calls recorded. With ``DUALPIPE_REF_DIR`` pointing at a checkout, the test also
traces the reference live instead of trusting the stored file.
"""
import json
import os
import pathlib

import pytest

from megatron_dualpipe.schedule import build_schedule

DATA = pathlib.Path(__file__).parents[1] / "data" / "reference_schedules.json"
REFERENCE = json.loads(DATA.read_text())


def _cases():
    return sorted(REFERENCE, key=lambda k: (k.split("/")[0], int(k.split("/")[1]), int(k.split("/")[2])))


def test_reference_covers_every_even_pp_to_16():
    for name in ("dualpipe", "dualpipev"):
        pps = {int(k.split("/")[1]) for k in REFERENCE if k.startswith(name + "/")}
        assert set(range(2, 17, 2)) <= pps


@pytest.mark.parametrize("key", _cases())
def test_generator_matches_reference_trace(key):
    name, pp, m = key.split("/")
    ours = build_schedule(name, int(pp), int(m))
    for rank, expected in enumerate(REFERENCE[key]):
        got = " ".join(str(a) for a in ours.ranks[rank])
        assert got == expected, f"{key} rank {rank}:\n ours {got}\n ref  {expected}"


@pytest.mark.skipif(not os.environ.get("DUALPIPE_REF_DIR"),
                    reason="set DUALPIPE_REF_DIR to a checkout of deepseek-ai/DualPipe to trace it live")
def test_live_trace_matches_stored_file():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "trace_reference", pathlib.Path(__file__).parents[2] / "tools" / "trace_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for key in ("dualpipe/8/20", "dualpipev/6/14", "dualpipe/16/38"):
        name, pp, m = key.split("/")
        ranks, _ = mod.trace(os.environ["DUALPIPE_REF_DIR"], name, int(pp), int(m))
        ours = build_schedule(name, int(pp), int(m))
        assert [" ".join(r) for r in ranks] == [" ".join(map(str, r)) for r in ours.ranks]

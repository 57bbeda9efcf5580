"""The ways of summing a DualPipe stage's two copies: one protocol, one module per way, chosen once
(``mcore.copies``).

Each way is one module with its ``WAY``; Megatron-LM's arguments choose one when the chunks are
built, the mark its DDP wrapper leaves on the chunks names it everywhere after. The scans keep the
choice from being re-made elsewhere: outside ``mcore/copies/`` no module reads the ways' marks, and
no module but the ways' own and the enum's tests which way it holds.
"""
from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

from megatron_dualpipe.mcore import copies
from megatron_dualpipe.mcore.copies.way import CopySumWay
from megatron_dualpipe.schedule import registry
from megatron_dualpipe.schedule.copy_sum import WAYS

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_dualpipe"
MARK_READERS = re.compile(r"\b(SHARED_ATTR|DP_FIRST_ATTR)\b")
#: A line that asks which way it holds (a branch on the way's name or its facts).
WAY_BRANCH = re.compile(r"(^\s*(el)?if\b|\bif\b.*\belse\b).*(\b(BD_FIRST|DP_FIRST|SHARED_SHARD)\b|"
                        r"shards_over_both_copies|sums_in_schedule|stage_ordered\b)")
#: Where the ways differ and the branch is the point: the enum's facts and the cost model's timing per way.
BRANCHING = {"schedule/copy_sum.py", "costs/comm_cost.py"}


def test_every_way_is_chosen_by_its_flag_and_named_by_its_mark():
    print(f"\nways: {copies.WAYS}; flags: {[way.way.flag for way in copies.WAYS]}")
    assert sorted(way.way for way in copies.WAYS) == sorted(WAYS)  # the cost model knows every way, and no other
    assert all(isinstance(way, CopySumWay) for way in copies.WAYS)
    assert copies.chosen(SimpleNamespace()) is copies.WAYS[0]
    assert copies.of([SimpleNamespace(), SimpleNamespace()]) is copies.WAYS[0]
    for way in copies.WAYS[1:]:
        attr = way.way.flag[2:].replace("-", "_")
        assert copies.chosen(SimpleNamespace(**{attr: True})) is way
        assert copies.of([SimpleNamespace(), SimpleNamespace(**{way.marker: True})]) is way
        assert way.wrap_ddp(object) is not object and not way.way.sums_in_schedule  # its wrapper sums the copies
    assert copies.WAYS[0].way.sums_in_schedule and copies.WAYS[0].wrap_ddp(object) is object


def test_a_way_needs_a_mirrored_schedule_and_one_way_at_a_time():
    both = SimpleNamespace(dualpipe_dp_first=True, dualpipe_shared_shard_group=True)
    print(copies.flag_problems(both, registry.DUALPIPE), copies.flag_problems(both, registry.ONE_F_ONE_B))
    assert copies.flag_problems(SimpleNamespace(dualpipe_dp_first=True), registry.DUALPIPE) == []
    assert "two ways to sum the copies" in copies.flag_problems(both, registry.DUALPIPE)[0]
    for name in registry.names(mirrored=False):
        assert f"use --pipeline-schedule {registry.DUALPIPE} or remove" in copies.flag_problems(both, name)[0]


def test_no_module_but_the_ways_reads_their_marks_or_branches_on_them():
    readers, branches = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        lines = path.read_text().splitlines()
        hits = [n for n, line in enumerate(lines, 1) if MARK_READERS.search(line)]
        if hits and not rel.startswith("mcore/copies/"):
            readers[rel] = hits
        hits = [n for n, line in enumerate(lines, 1) if WAY_BRANCH.search(line.split("#")[0])]
        if hits and rel not in BRANCHING:
            branches[rel] = hits
    print(f"\nmodules reading the ways' marks outside the ways: {readers}; branching on a way: {branches}")
    assert not readers and not branches, (readers, branches)

"""schedule.copy_sum: the ways of summing a mirrored stage's two copies, declared once, and the one
stage-order rule every collective issued outside the schedule follows. Standard library only."""
from __future__ import annotations

import pathlib
import re

import pytest

from megatron_dualpipe.schedule import registry
from megatron_dualpipe.schedule.copy_sum import BD_FIRST, DP_FIRST, WAYS, CopySum, stage_order
from megatron_dualpipe.schedule.layout import BIDIRECTIONAL, Layout
from harness.shard_group_ranks import stage_of

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_dualpipe"


def test_stage_order_is_one_order_for_both_partners():
    for pp in (2, 4, 8):
        layout = Layout(BIDIRECTIONAL, pp)
        for r in range(pp):
            mine = [stage_of(pp, r, c) for c in stage_order(layout, r)]
            theirs = [stage_of(pp, pp - 1 - r, c) for c in stage_order(layout, pp - 1 - r)]
            assert mine == theirs == sorted(mine)
    assert stage_order(registry.get(registry.DUALPIPEV).layout(4), 1) == [0, 1]  # no copies: chunk order


def test_the_way_names_parse_and_print_as_text():
    assert [str(w) for w in WAYS] == ["bd-first", "dp-first", "shared-shard"] and WAYS[0] is BD_FIRST
    assert all(CopySum(f"{w}") is w for w in WAYS)
    with pytest.raises(ValueError, match="pair-first"):
        CopySum("pair-first")


def test_a_layout_without_copies_sums_nothing():
    one = registry.get(registry.ZB_H1).layout(4)
    assert {w.on(one) for w in WAYS} == {BD_FIRST}
    mirrored = registry.get(registry.DUALPIPE).layout(4)
    assert [w.on(mirrored) for w in WAYS] == list(WAYS)
    assert [w.sums_in_schedule for w in WAYS] == [True, False, False]
    assert DP_FIRST.pair_sum_bytes(8.0, 2, True) == 4.0 and DP_FIRST.pair_sum_bytes(8.0, 2, False) == 8.0
    assert [w.flag for w in WAYS] == [None, "--dualpipe-dp-first", "--dualpipe-shared-shard-group"]


def test_the_mode_strings_are_declared_once():
    """Outside this module no source spells a way's text as a string literal (the options' texts and
    the cost model read the enum)."""
    literal = re.compile(r"""["'](bd-first|dp-first|shared-shard)["']""")
    found = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if literal.search(p.read_text())}
    print(f"\nmodules spelling a way's name: {sorted(found)}")
    assert found == {"schedule/copy_sum.py"}

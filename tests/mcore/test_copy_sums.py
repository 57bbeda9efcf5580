"""The ways of summing a DualPipe stage's two copies: one interface, chosen once (``mcore.copy_sums``).

Each way is one module with its ``CopySum``; Megatron-LM's arguments choose one when the chunks
are built, the mark its DDP wrapper leaves on the chunks names it everywhere after. The scan
keeps the choice from being re-made elsewhere: outside the ways' modules only the registry reads
their marks (the shared shard group's checkpoint files, ``megatron_lm.checkpoint.strategies``,
are that way's own format and the one place left).
"""
from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

from megatron_dualpipe.mcore import copy_sums
from megatron_dualpipe.costs.comm_cost import BD_MODES

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_dualpipe"
WAY_MODULES = {"mcore/copy_sum.py", "mcore/copy_sums.py", "mcore/bd_first.py", "mcore/dp_first.py",
               "mcore/shared_shard_wrap.py", "mcore/shard_groups.py"}
#: The shared shard group's checkpoint format: that way's own, in the megatron_lm layer.
KNOWN = {"megatron_lm/checkpoint/strategies.py"}
MARK_READERS = re.compile(r"\b(is_shared_layout|is_dp_first|SHARED_ATTR|DP_FIRST_ATTR)\b")


def test_every_way_is_chosen_by_its_flag_and_named_by_its_mark():
    names = [way.name for way in copy_sums.WAYS]
    print(f"\nways: {names}; flags: {[way.flag for way in copy_sums.WAYS]}")
    assert sorted(names) == sorted(BD_MODES)  # the cost model knows every way, and no other
    assert copy_sums.chosen(SimpleNamespace()) is copy_sums.WAYS[0]
    assert copy_sums.of([SimpleNamespace(), SimpleNamespace()]) is copy_sums.WAYS[0]
    for way in copy_sums.WAYS[1:]:
        assert copy_sums.chosen(SimpleNamespace(**{way.flag: True})) is way
        assert copy_sums.of([SimpleNamespace(), SimpleNamespace(**{way.marker: True})]) is way
        assert way.wrap_ddp is not None and not way.sums_in_schedule  # its wrapper sums the copies
    assert copy_sums.WAYS[0].sums_in_schedule and copy_sums.WAYS[0].wrap_ddp is None


def test_no_module_but_the_registry_reads_the_ways_marks():
    readers = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1) if MARK_READERS.search(line)]
        if hits and rel not in WAY_MODULES:
            readers[rel] = hits
    print(f"\nmodules reading the ways' marks outside the ways: {readers}")
    assert set(readers) <= KNOWN, readers

"""Makes ``tests/harness`` importable as ``harness`` whatever pytest's import mode."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_collection_modifyitems(items):
    """The Megatron-LM files first (stable sort: each file's own order kept): each runs many
    ``pretrain_gpt.py`` jobs of several minutes in all, and ``pytest -n 2 --dist loadfile`` hands
    files out in collection order, so started last they left one worker running alone at the end
    (17 min instead of ~14 on 2 cores)."""
    items.sort(key=lambda item: 0 if os.path.basename(str(item.fspath)).startswith("test_megatron_lm") else 1)

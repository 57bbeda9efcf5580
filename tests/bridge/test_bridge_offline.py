"""The Bridge adapter's pieces that need no Megatron-Bridge: which Bridge and megatron-core pairs the
version gate accepts. (The grad-buffer offsets its checkpoint save uses are Megatron-LM's loop's:
tests/megatron_lm/test_checkpoint_strategies.py.)"""
from __future__ import annotations

import pytest

from megatron_dualpipe import versions
from megatron_dualpipe.bridge import version_gate


@pytest.fixture(autouse=True)
def _checked(monkeypatch):
    monkeypatch.delenv(versions.SKIP_ENV, raising=False)


@pytest.mark.parametrize("bridge, core", [("0.3.1", "0.16.1"), ("0.6.2", "0.19.2"), ("0.6.0", "0.19.0")])
def test_each_bridge_series_with_its_megatron_core_is_accepted(bridge, core):
    assert version_gate.problem(bridge, core) is None


@pytest.mark.parametrize("bridge, core", [("0.6.2", "0.16.1"), ("0.3.1", "0.19.2")])
def test_a_bridge_on_another_series_megatron_core_is_refused_naming_both(bridge, core):
    said = version_gate.problem(bridge, core)
    assert said and f"megatron-bridge {bridge}" in said and f"megatron-core {core}" in said and "\n" not in said


@pytest.mark.parametrize("bridge", ["0.4.2", "0.5.1", "0.7.0", None])
def test_an_unknown_bridge_is_refused_naming_both_known_series(bridge):
    said = version_gate.problem(bridge, "0.19.2")
    assert "megatron-bridge>=0.3.1,<0.4" in said and "megatron-bridge>=0.6,<0.7" in said


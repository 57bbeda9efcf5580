"""The Bridge adapter's pieces that need no Megatron-Bridge: which Bridge and megatron-core pairs the
version gate accepts, and the grad-buffer offsets its checkpoint save uses (``bridge.checkpoint``) on a
buffer laid out as megatron-core lays out a first stage with a tied embedding."""
from __future__ import annotations

from types import SimpleNamespace

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


def test_offsets_without_the_padding_between_buckets():
    """megatron-core pads a bucket's end to a multiple of 128 under the distributed optimizer and gives the
    tied embedding a bucket of its own after the rest of the first stage; the state it gathers for the fully
    reshardable save leaves that padding out. Bucket 0 here holds 192 elements, padded to 256: bucket 1 (the
    embedding) starts at 256 in the buffer and at 192 in the gathered state."""
    from megatron_dualpipe.bridge.checkpoint import _unpadded_offsets

    norm, weight, embedding = object(), object(), object()
    buckets = [SimpleNamespace(grad_data=SimpleNamespace(numel=lambda: 256), numel_unpadded=192),
               SimpleNamespace(grad_data=SimpleNamespace(numel=lambda: 16384), numel_unpadded=16384)]
    index = {norm: (0, 64, 0), weight: (64, 192, 0), embedding: (256, 256 + 16384, 1)}
    buffer = SimpleNamespace(buckets=buckets, param_index_map=index)
    assert _unpadded_offsets(buffer) == {norm: (0, 64, 0), weight: (64, 192, 0),
                                         embedding: (192, 192 + 16384, 1)}

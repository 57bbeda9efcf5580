"""The equality check: how far numbers under test are from a reference, as one printed line;
relative to the largest reference value, so one tolerance serves any loss and any layer.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def rel_diff(got: Any, want: Any) -> float:
    """max |got - want| / max |want| (the absolute difference where ``want`` is all zero)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} against the reference's {want.shape}")
    if not want.size:
        return 0.0
    scale = float(np.max(np.abs(want)))
    diff = float(np.max(np.abs(got - want)))
    return diff / scale if scale > 0 else diff


class Gap:
    """Differences from a reference over many pairs: ``rel`` over all of them (the largest
    difference over the largest reference value), ``worst`` the largest of each pair's own."""

    def __init__(self) -> None:
        self.diff = self.scale = self.worst = 0.0
        self.where = self.worst_where = ""
        self.pairs = 0

    def add(self, got: Any, want: Any, where: str = "") -> float:
        """Take one pair in; return its own relative difference. NaN or inf counts as infinitely far."""
        got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
        finite = bool(np.all(np.isfinite(got)))
        rel = rel_diff(got, want) if finite else float("inf")
        diff = (float(np.max(np.abs(got - want))) if finite else float("inf")) if want.size else 0.0
        self.pairs += 1
        if diff > self.diff or not self.where:
            self.diff, self.where = max(diff, self.diff), where
        if want.size:
            self.scale = max(self.scale, float(np.max(np.abs(want))))
        if rel > self.worst or not self.worst_where:
            self.worst, self.worst_where = max(rel, self.worst), where
        return rel

    @property
    def rel(self) -> float:
        """The largest difference over the largest reference value, over every pair."""
        return self.diff / self.scale if self.scale > 0 else self.diff

    def line(self, what: str) -> str:
        """``what``: max|diff| D (rel R) over N pairs, largest at NAME."""
        at = f", largest at {self.where}" if self.where else ""
        return f"{what}: max|diff| {self.diff:.2e} (rel {self.rel:.2e}) over {self.pairs} pairs{at}"

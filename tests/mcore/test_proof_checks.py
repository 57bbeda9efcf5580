"""The proof harness's checks can fail: the equality check on a difference past the tolerance (and on
NaN), the no-hang check on a peer that finished, named no rank, or took too long.

Both are what the other tests and ``megatron-dualpipe selftest`` judge with
(:mod:`megatron_dualpipe.proof.compare`, :mod:`megatron_dualpipe.proof.nohang`); these cases feed
them made-up records, so no process starts.
"""
from __future__ import annotations

import numpy as np
import pytest

from megatron_dualpipe.proof.compare import Gap, rel_diff
from megatron_dualpipe.proof.nohang import InjectedFailure, Stop, attempt, peers_stopped, raising_forward_step


def test_gap_is_the_largest_difference_over_the_largest_reference_value():
    gap = Gap()
    assert gap.add([1.0, 2.0], [1.0, 2.0], "same") == 0.0
    assert gap.add([0.0, 1e-3], [1e-3, 1e-3], "small") == pytest.approx(1.0)  # its own scale is tiny
    print("\n" + gap.line("two tensors"))
    assert gap.rel == pytest.approx(1e-3 / 2.0) and gap.where == "small" and gap.worst_where == "small"
    assert gap.rel <= 1e-3 and not gap.rel <= 1e-4  # a tolerance it meets and one it does not
    assert gap.add([float("nan"), 2.0], [1.0, 2.0], "nan") == float("inf") and gap.rel == float("inf")
    assert rel_diff([0.0, 1e-6], [0.0, 0.0]) == 1e-6  # a zero reference: the absolute difference
    with pytest.raises(ValueError, match="shapes differ"):
        rel_diff(np.zeros(2), np.zeros(3))


def test_peers_stopped_names_each_way_to_hang():
    stops = {0: Stop("ValueError: bad shape", 1.0, 100.0),
             1: Stop("PeerFailedError: stopped waiting because global rank 0 failed", 1.2, 100.2),
             2: Stop(None, 3.0, 103.0),
             3: Stop("RuntimeError: connection closed", 1.5, 100.5),
             4: Stop("PeerFailedError: global rank 0 failed", 9.0, 109.0)}
    problems = peers_stopped(stops, 0, 5.0, failed_at=100.0)
    print("\n" + "\n".join(problems))
    assert problems == ["rank 2 finished although rank 0 failed",
                        "rank 3 stopped with an error that names no rank: RuntimeError: connection closed",
                        "rank 4 took 9.0 s to stop, more than 5 s"]
    assert peers_stopped({r: stops[r] for r in (0, 1)}, 0, 5.0) == []  # of its own start: 1.2 s


def test_raising_forward_step_raises_at_its_nth_call_on_the_failing_rank_only():
    calls = []
    step = raising_forward_step(lambda it, model: calls.append(model), fails=True, nth=2)
    stop = attempt(lambda: [step(None, k) for k in range(3)])
    assert stop.kind == "InjectedFailure" and calls == [0] and stop.seconds >= 0
    healthy = raising_forward_step(lambda it, model: calls.append(model), fails=False, nth=2)
    assert attempt(lambda: [healthy(None, k) for k in range(3)]).error is None and calls == [0, 0, 1, 2]
    assert issubclass(InjectedFailure, RuntimeError)

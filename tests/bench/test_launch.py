"""What the parent of the spawned ranks says when one of them dies: the dead rank is named as the
cause even when a neighbour's error (its echo) reaches the queue first."""
import queue

import pytest

from megatron_dualpipe.bench import launch


class _Proc:
    def __init__(self, exitcode):
        self.exitcode = exitcode


def _queue(*items):
    q = queue.Queue()
    for item in items:
        q.put(item)
    return q


def test_a_neighbours_error_after_a_rank_died_names_the_dead_rank_last(monkeypatch):
    """Rank 1 was stopped by its watchdog (exit 3, no report of its own); rank 0's collective then
    failed with gloo's 'connection closed by peer'. The last line, which the selftest prints, must
    name rank 1 first (CI of stop 22 printed only rank 0's echo)."""
    monkeypatch.setattr(launch, "REPORT_GRACE_S", 0.1)
    echo = ("rank 0:\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
            "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:12713")
    with pytest.raises(RuntimeError) as raised:
        launch._await_result(_queue(("error", echo)), [_Proc(None), _Proc(3)], timeout_s=5, poll_s=0.01)
    last = str(raised.value).splitlines()[-1]
    print(last)
    assert last.startswith("benchmark workers ended without a result: rank 1 exited with code 3")
    assert last.endswith("after it, rank 0: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:12713")
    assert "Traceback" in str(raised.value)  # the echo's traceback is kept above


def test_a_rank_that_died_after_rank_0_reported_does_not_spoil_the_result(monkeypatch):
    monkeypatch.setattr(launch, "REPORT_GRACE_S", 0.1)
    q = queue.Queue()  # the result arrives during the grace, after the poll saw the dead rank
    procs = [_Proc(None), _Proc(-9)]

    class LateQueue:
        calls = 0

        def get(self, timeout):
            LateQueue.calls += 1
            if LateQueue.calls == 1:
                raise queue.Empty
            return ("ok", ["r0", "r1"])

    assert launch._await_result(LateQueue(), procs, timeout_s=5, poll_s=0.01) == ("ok", ["r0", "r1"])
    del q


def test_a_dead_rank_and_no_report_names_the_rank(monkeypatch):
    monkeypatch.setattr(launch, "REPORT_GRACE_S", 0.1)
    with pytest.raises(RuntimeError, match=r"without a result: rank 1 was killed by signal 9 \(their own output"):
        launch._await_result(_queue(), [_Proc(None), _Proc(-9)], timeout_s=5, poll_s=0.01)


def test_an_error_with_no_death_is_returned_as_the_cause(monkeypatch):
    monkeypatch.setattr(launch, "DEATH_SHOWS_S", 0.1)
    got = launch._await_result(_queue(("error", "rank 1:\nValueError: bad")), [_Proc(None), _Proc(0)],
                               timeout_s=5, poll_s=0.01)
    assert got == ("error", "rank 1:\nValueError: bad")

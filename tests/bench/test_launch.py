"""The package's one spawner of ranks (megatron_dualpipe/launch/spawn.py; the benchmark, the selftest
and the tests' workers start theirs through it): every rank's result in rank order, and when a rank
fails, the cause named last (the line the selftest prints): a rank that died without a report before
a neighbour's error, which is often its echo."""
import queue

import pytest

from megatron_dualpipe.launch import spawn


class _Proc:
    def __init__(self, exitcode):
        self.pid, self.exitcode = None, exitcode


def _collect(tmp_path, procs, *reports, timeout_s=5):
    results = queue.Queue()
    for report in reports:
        results.put(report)
    return spawn._collect(results, spawn.Ranks(procs, str(tmp_path / "rank")), timeout_s)


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch):
    monkeypatch.setattr(spawn, "REPORT_GRACE_S", 0.1)


def test_a_neighbours_error_after_a_rank_died_names_the_dead_rank_last(tmp_path):
    """Rank 1 was stopped by its watchdog (exit 3, no report of its own); rank 0's collective then
    failed with gloo's 'connection closed by peer'. The last line, which the selftest prints, must
    name rank 1 first (CI of stop 22 printed only rank 0's echo)."""
    echo = ("rank 0:\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
            "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:12713")
    with pytest.raises(RuntimeError) as raised:
        _collect(tmp_path, [_Proc(None), _Proc(3)], (0, "error", echo))
    last = str(raised.value).splitlines()[-1]
    print(last)
    assert last.startswith("ranks ended without a result: rank 1 exited with code 3")
    assert last.endswith("after it, rank 0: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:12713")
    assert "Traceback" in str(raised.value)  # the echo's traceback is kept above


def test_a_rank_that_ended_badly_after_its_report_does_not_spoil_the_results(tmp_path):
    got = _collect(tmp_path, [_Proc(0), _Proc(-9)], (1, "ok", "r1"), (0, "ok", "r0"))
    assert got == ["r0", "r1"]


def test_a_dead_rank_and_no_report_names_the_rank(tmp_path):
    with pytest.raises(RuntimeError, match=r"without a result: rank 1 was killed by signal 9 \(their own output"):
        _collect(tmp_path, [_Proc(None), _Proc(-9)], (0, "ok", "r0"))


def test_an_error_with_no_death_is_the_cause(tmp_path):
    with pytest.raises(RuntimeError) as raised:
        _collect(tmp_path, [_Proc(None), _Proc(1)], (1, "error", "rank 1:\nValueError: bad"))
    assert str(raised.value) == "a rank failed: rank 1:\nValueError: bad"


def returns_its_rank(rank, world, port, offset):
    return rank + offset


def raises_on_rank_1(rank, world, port):
    if rank == 1:
        raise ValueError("rank 1 says no")
    return rank


def test_spawned_ranks_return_in_rank_order_and_a_failure_is_the_last_line():
    assert spawn.run(returns_its_rank, 3, (10,), timeout_s=60) == [10, 11, 12]
    with pytest.raises(RuntimeError) as raised:
        spawn.run(raises_on_rank_1, 2, timeout_s=60)
    assert str(raised.value).splitlines()[-1] == "ValueError: rank 1 says no"

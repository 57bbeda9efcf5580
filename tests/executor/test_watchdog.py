"""The iteration's watchdog on fake works (no processes): a missed deadline names the wait, tells
every rank and aborts the communicators; an exception that abort caused becomes the named error;
the iteration's end waits for what is outstanding, and nothing of the watchdog acts after it."""
import threading
import time

import pytest

from megatron_dualpipe.executor import abort, watchdog


class FakeWork:
    def __init__(self):
        self.finished = threading.Event()

    def is_completed(self):
        return self.finished.is_set()

    def wait(self, *args):
        return True  # a stream wait: returns at once


@pytest.fixture
def aborts(monkeypatch):
    seen = {"aborted": [], "signalled": []}
    monkeypatch.setattr(watchdog, "POLL_S", 0.002)
    monkeypatch.setattr(watchdog, "abort_communicators", lambda: seen["aborted"].append(time.monotonic()))
    monkeypatch.setattr(abort, "signal", lambda message: seen["signalled"].append(message))
    return seen


WHAT = "global rank 3: the bd sum of stage 1 with global rank 1"


def test_a_missed_deadline_names_the_wait_tells_every_rank_and_aborts(aborts):
    t0 = time.monotonic()
    with pytest.raises(watchdog.StreamWaitTimeoutError) as e:
        with watchdog.watching(timeout_s=600):
            abort.wait_work(FakeWork(), 0.2, WHAT, on_host=False)  # returns: the stream waits
            assert watchdog.current().outstanding()
            while not aborts["aborted"]:
                time.sleep(0.01)
            raise RuntimeError("NCCL communicator was aborted")  # what the host then sees
    elapsed = time.monotonic() - t0
    print(f"\nafter {elapsed:.2f} s: {e.value}\n  signalled: {aborts['signalled']}")
    assert WHAT in str(e.value) and "within 0.2 s" in str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError)
    assert len(aborts["signalled"]) == 1 and WHAT in aborts["signalled"][0]
    assert 0.2 <= elapsed < 30  # the deadline's 0.2 s, not the watching's 600 s


def test_the_end_of_the_iteration_waits_for_outstanding_works_then_the_watchdog_stops(aborts):
    """The work completes 0.3 s in; the deadline (3 s) leaves a loaded machine's late timer room."""
    deadline_s = 3.0
    work = FakeWork()
    threading.Timer(0.3, work.finished.set).start()
    t0 = time.monotonic()
    with watchdog.watching(timeout_s=deadline_s) as dog:
        abort.wait_work(work, None, WHAT, on_host=False)
    drained = time.monotonic() - t0
    late = FakeWork()  # tracked by nobody: the iteration is over
    time.sleep(deadline_s + 0.2 - drained)  # past every deadline of the iteration
    print(f"\nthe iteration ended {drained:.2f} s after its last wait; watchdog alive: {dog.is_alive()}, "
          f"aborts: {aborts['aborted']}")
    assert 0.25 < drained < deadline_s and work.is_completed()
    assert not dog.is_alive() and not aborts["aborted"] and watchdog.current() is None
    abort.wait_work(late, None, WHAT, on_host=False)  # outside an iteration: a bare stream wait


def test_a_failed_iteration_stops_its_watchdog_at_once(aborts):
    with pytest.raises(ValueError):
        with watchdog.watching(timeout_s=0.2) as dog:
            abort.wait_work(FakeWork(), None, WHAT, on_host=False)
            raise ValueError("this rank's own error")
    time.sleep(0.4)
    assert not dog.is_alive() and not aborts["aborted"] and not aborts["signalled"]

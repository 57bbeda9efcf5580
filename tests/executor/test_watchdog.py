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


class LateDevice:
    """Where the device is when the host issues a stream wait: its earlier kernels still run, and
    the recorded event completes ``delay_s`` later (``torch.cuda.Event.query()``'s contract)."""

    def __init__(self, delay_s):
        self.at = time.monotonic() + delay_s

    def query(self):
        return time.monotonic() >= self.at


def test_a_deadline_counts_from_when_the_device_reaches_the_wait(aborts, monkeypatch):
    """Issue 35, finding 5. The host issues the wait at once and runs on; the device reaches it 0.6 s
    later (its earlier kernels), and the work completes 0.1 s after that. With a 0.3 s deadline a
    healthy run is not aborted: the clock starts at 0.6 s (counted from the issue, as before, it was
    aborted at 0.3 s). A wait the device reaches that never completes still misses its deadline,
    counted from the device's arrival (0.6 + 0.3 s)."""
    monkeypatch.setattr(watchdog, "device_marker", lambda: LateDevice(0.6))
    work = FakeWork()
    threading.Timer(0.7, work.finished.set).start()
    t0 = time.monotonic()
    with watchdog.watching(timeout_s=600):
        abort.wait_work(work, 0.3, WHAT, on_host=False)
    healthy = time.monotonic() - t0
    print(f"\nhealthy: the iteration ended after {healthy:.2f} s, aborts {aborts['aborted']}")
    assert work.is_completed() and not aborts["aborted"]
    t0 = time.monotonic()
    with pytest.raises(watchdog.StreamWaitTimeoutError) as e:
        with watchdog.watching(timeout_s=600):
            abort.wait_work(FakeWork(), 0.3, WHAT, on_host=False)
            while not aborts["aborted"]:
                time.sleep(0.01)
            raise RuntimeError("NCCL communicator was aborted")
    stuck = time.monotonic() - t0
    print(f"stuck: aborted after {stuck:.2f} s: {e.value}")
    assert 0.9 <= stuck < 30 and WHAT in str(e.value)


def test_the_abort_calls_each_groups_own_abort_and_leaves_torchs_registry(monkeypatch):
    """Issue 35, finding 5: the watchdog's thread aborts every group through the backend's own
    ``ProcessGroup.abort()`` and no longer through torch's experimental ``_abort_process_group()``,
    which also rewrites torch's group registry under the main thread's feet."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from megatron_dualpipe.launch.ports import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        extra = dist.new_group([0])
        aborted = []
        monkeypatch.setattr(dist.ProcessGroup, "abort", lambda self: aborted.append(self), raising=False)
        monkeypatch.setattr(c10d, "_abort_process_group", lambda *a: pytest.fail("the experimental abort was called"))
        before = dict(c10d._world.pg_names)
        thread = threading.Thread(target=watchdog.abort_communicators)
        thread.start()
        thread.join()
        print(f"\naborted {len(aborted)} of {len(before)} groups; registry kept: {dict(c10d._world.pg_names) == before}")
        assert set(aborted) == set(before) and extra in aborted and dict(c10d._world.pg_names) == before
        # NCCL (emulated): the aborts inside one group start / end of the default group's NCCL backend
        calls = []

        class FakeNCCL:
            _group_start = staticmethod(lambda: calls.append("start"))
            _group_end = staticmethod(lambda: calls.append("end"))

        monkeypatch.setattr(c10d, "is_nccl_available", lambda: True)
        monkeypatch.setattr(c10d, "ProcessGroupNCCL", FakeNCCL, raising=False)
        monkeypatch.setattr(dist.ProcessGroup, "_get_backend", lambda self, device: FakeNCCL())
        monkeypatch.setattr(dist.ProcessGroup, "abort", lambda self: calls.append("abort"), raising=False)
        watchdog.abort_communicators()
        print(f"with NCCL: {calls}")
        assert calls == ["start"] + ["abort"] * len(before) + ["end"]
    finally:
        dist.destroy_process_group()

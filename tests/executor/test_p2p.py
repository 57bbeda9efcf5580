"""The P2P layer's waiting discipline, on fake communication works (no processes).

* Accelerator discipline (NCCL): a receive only makes the stream wait (``work.wait()`` without a
  timeout, the host never blocks); a send's buffer is released once the watchdog has seen
  ``is_completed()``; a receive past its deadline is reported by the watchdog, naming rank,
  peer and action, logged at once, and raised by the runner's next P2P call.
* Host discipline (gloo): a thread per peer waits for the sends in order; a send's buffer is
  released at the first ``reap`` after its send completed, never before.
"""
import logging
import threading
import time

import pytest
import torch

from megatron_dualpipe.executor import p2p as p2p_mod
from megatron_dualpipe.executor import watchdog as watchdog_mod
from megatron_dualpipe.executor.p2p import P2P, P2PTimeoutError
from megatron_dualpipe.schedule.comm import describe


class FakeWork:
    def __init__(self):
        self.finished = threading.Event()
        self.wait_args = []

    def is_completed(self):
        return self.finished.is_set()

    def wait(self, *args):
        self.wait_args.append(args)
        if args:  # the host discipline passes a timeout: block like gloo
            return self.finished.wait(args[0].total_seconds())
        if threading.current_thread() is not threading.main_thread():
            self.finished.wait()  # a host waiter thread
        return True  # the runner's thread: a stream wait returns at once


@pytest.fixture
def fake_dist(monkeypatch):
    works = []

    def batch(ops):
        new = [FakeWork() for _ in ops]
        works.extend(new)
        return new

    monkeypatch.setattr(p2p_mod.dist, "P2POp", lambda op, t, peer, group: type("Op", (), {"tensor": t})())
    monkeypatch.setattr(p2p_mod.dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(p2p_mod.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(watchdog_mod, "POLL_S", 0.002)
    return works


def _until(cond, seconds=5.0):
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


ACT, GRAD = ("act", 0, 1, 1), ("grad", 1, 0, 0)


def test_accelerator_discipline_never_blocks_and_releases_completed_sends(fake_dist):
    p2p = P2P(None, [0, 1], 0, timeout_s=30, host_waits=False)
    released = []
    p2p.post([(1, torch.zeros(2), ACT, lambda: released.append(ACT))], [(1, torch.zeros(2), GRAD)],
             "before action 2 (F0.1)")
    send, recv = fake_dist
    t0 = time.monotonic()
    p2p.receive(GRAD, "before action 3 (B1.0)")
    assert time.monotonic() - t0 < 10 and recv.wait_args == [()]  # a stream wait, no timeout (30 s)
    p2p.reap()
    assert released == []  # the send has not completed
    send.finished.set()
    assert _until(lambda: p2p._sends[0].done)  # the watchdog saw is_completed()
    p2p.reap()
    print(f"\nreleased {released}; send waits {send.wait_args}")
    assert released == [ACT] and send.wait_args == [()]
    recv.finished.set()
    p2p.finish("after its last action")
    assert not p2p._watchdog.is_alive()  # finish drained it and stopped it: nothing watched after finish


def test_accelerator_watchdog_reports_a_late_receive(fake_dist, monkeypatch, caplog):
    aborted = []
    monkeypatch.setattr(watchdog_mod, "abort_communicators", lambda: aborted.append(True))
    p2p = P2P(None, [0, 5], 0, timeout_s=0.3, host_waits=False)
    p2p.post([], [(1, torch.zeros(2), GRAD)], "before action 2 (F0.1)")
    with caplog.at_level(logging.ERROR, logger="megatron_dualpipe"):
        p2p.receive(GRAD, "before action 3 (B1.0)")  # returns: the stream waits, the host goes on
        assert _until(lambda: aborted)
    with pytest.raises(P2PTimeoutError) as e:
        p2p.reap()
    msg = str(e.value)
    print(f"\n{msg}")
    for part in ("pipeline rank 0 (global 0) before action 3 (B1.0)",
                 f"receive of {describe(GRAD)} from pipeline rank 1 (global 5)", "within 0.3 s",
                 "MEGATRON_DUALPIPE_P2P_TIMEOUT"):
        assert part in msg
    assert any("within 0.3 s" in r.getMessage() for r in caplog.records)  # logged when found


def test_host_discipline_releases_a_send_after_it_completed(fake_dist):
    p2p = P2P(None, [0, 1], 0, timeout_s=30)
    released = []
    p2p.post([(1, torch.zeros(2), ACT, lambda: released.append(ACT))], [], "before action 2 (F0.1)")
    assert p2p.host_waits  # CPU tensors: the host waits
    (send,) = fake_dist
    p2p.reap()
    assert released == []
    send.finished.set()
    assert _until(lambda: p2p._sends[0].done)  # the peer's waiter thread saw it complete
    p2p.reap()
    assert released == [ACT]
    p2p.finish("after its last action")


def test_host_discipline_finish_names_a_send_that_never_completes(fake_dist):
    p2p = P2P(None, [0, 1], 0, timeout_s=0.3)
    p2p.post([(1, torch.zeros(2), ACT, None)], [], "before action 2 (F0.1)")
    with pytest.raises(P2PTimeoutError) as e:
        p2p.finish("after its last action")
    msg = str(e.value)
    print(f"\n{msg}")
    for part in ("pipeline rank 0 (global 0) after its last action",
                 f"send of {describe(ACT)} to pipeline rank 1", "posted before action 2 (F0.1)", "within 0.3 s"):
        assert part in msg


def test_posting_to_a_dead_peer_names_the_batch(fake_dist, monkeypatch):
    """gloo refuses to post to a peer whose connection has closed (a rank killed while this one was
    computing): the error names every send and receive of the batch, hence the peer."""
    def closed(ops):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:14225")
    monkeypatch.setattr(p2p_mod.dist, "batch_isend_irecv", closed)
    p2p = P2P(None, [0, 4, 5], 1, timeout_s=30)
    with pytest.raises(P2PTimeoutError) as e:
        p2p.post([(2, torch.zeros(2), ACT, None)], [(0, torch.zeros(2), GRAD)], "before action 3 (F0.1)")
    msg = str(e.value)
    print(f"\n{msg}")
    for part in ("pipeline rank 1 (global 0) before action 3 (F0.1): posting the point-to-point batch",
                 f"send of {describe(ACT)} to pipeline rank 2 (global 5)",
                 f"receive of {describe(GRAD)} from pipeline rank 0 (global 0)", "a peer probably exited",
                 "Connection closed by peer"):
        assert part in msg


def test_complete_send_releases_before_returning(fake_dist):
    """Before a backward, the runner asks for its forward's output to be released (Megatron's
    custom_backward asserts it): complete_send returns only once the send completed and its
    buffer was released, however late the waiter thread notices."""
    p2p = P2P(None, [0, 1], 0, timeout_s=30)
    released = []
    p2p.post([(1, torch.zeros(2), ACT, lambda: released.append(ACT))], [], "before action 2 (F0.1)")
    (send,) = fake_dist
    threading.Timer(0.2, send.finished.set).start()
    p2p.complete_send(ACT, "before action 5 (B0.1)")
    assert released == [ACT] and p2p._sends == []
    p2p.complete_send(ACT, "before action 5 (B0.1)")  # already released: nothing to do
    assert released == [ACT]
    p2p.finish("after its last action")


def test_accelerator_watchdog_does_not_outlive_a_failed_iteration(fake_dist, monkeypatch):
    """The runner closes the P2P without ``finish`` when an action raised: the watchdog stops at
    once and never aborts the group later for that iteration's unfinished receive."""
    aborted = []
    monkeypatch.setattr(watchdog_mod, "abort_communicators", lambda: aborted.append(True))
    p2p = P2P(None, [0, 1], 0, timeout_s=0.2, host_waits=False)
    p2p.post([], [(1, torch.zeros(2), GRAD)], "before action 2 (F0.1)")
    p2p.receive(GRAD, "before action 3 (B1.0)")  # the stream waits; the receive never completes
    watchdog = p2p._watchdog
    p2p.close()  # the runner's finally after an exception
    assert _until(lambda: not watchdog.is_alive(), 1.0)
    time.sleep(0.4)  # past the receive's deadline
    print(f"\nwatchdog alive: {watchdog.is_alive()}, aborts: {aborted}")
    assert not aborted


def test_accelerator_watchdog_stops_on_a_peer_failure(fake_dist, monkeypatch):
    """A peer signalled its failure (executor.abort): the watchdog aborts the group and the next P2P
    call raises PeerFailedError naming this rank, what it waited for and the peer's error."""
    from megatron_dualpipe.executor import abort

    aborted = []
    monkeypatch.setattr(watchdog_mod, "abort_communicators", lambda: aborted.append(True))
    failed = []
    monkeypatch.setattr(abort, "failure", lambda: failed[0] if failed else None)
    p2p = P2P(None, [0, 1], 0, timeout_s=600, host_waits=False)
    p2p.post([], [(1, torch.zeros(2), GRAD)], "before action 2 (F0.1)")
    p2p.receive(GRAD, "before action 3 (B1.0)")
    failed.append("global rank 1 failed: ValueError: boom")
    t0 = time.monotonic()
    assert _until(lambda: aborted, 2.0)
    with pytest.raises(abort.PeerFailedError) as e:
        p2p.reap()
    msg = str(e.value)
    print(f"\nafter {time.monotonic() - t0:.2f} s: {msg}")
    for part in ("pipeline rank 0 (global 0)", f"receive of {describe(GRAD)} from pipeline rank 1",
                 "because global rank 1 failed: ValueError: boom"):
        assert part in msg


def test_host_receive_stops_on_a_peer_failure(fake_dist, monkeypatch):
    from megatron_dualpipe.executor import abort

    failed = []
    monkeypatch.setattr(abort, "failure", lambda: failed[0] if failed else None)
    p2p = P2P(None, [0, 1], 0, timeout_s=600, host_waits=True)
    p2p.post([], [(1, torch.zeros(2), GRAD)], "before action 2 (F0.1)")
    threading.Timer(0.3, lambda: failed.append("global rank 1 failed: ValueError: boom")).start()
    t0 = time.monotonic()
    with pytest.raises(abort.PeerFailedError) as e:
        p2p.receive(GRAD, "before action 3 (B1.0)")
    elapsed = time.monotonic() - t0
    print(f"\nafter {elapsed:.2f} s: {e.value}")
    assert elapsed < 5.0
    for part in ("pipeline rank 0 (global 0) before action 3 (B1.0)", f"receive of {describe(GRAD)}",
                 "because global rank 1 failed: ValueError: boom"):
        assert part in str(e.value)

"""The abort listener at the interpreter's exit: on a store it polls (rank 0's, no torchrun agent),
no store call may be in flight once Python finalizes; a thread coming back from the store's C++
call then aborts the process ("terminate called without an active exception": a CI run, rank 1 at
the end of a successful run, tests/megatron_lm/test_preloaded_launch.py)."""
import threading
import time

from megatron_dualpipe.executor.abort_listener import Listener


class SlowStore:
    """Not a TCPStore, so polled; each check takes ``check_s``, and says when it was in flight."""

    def __init__(self, check_s):
        self.check_s, self.calls, self.in_flight = check_s, [], threading.Event()

    def check(self, keys):
        self.in_flight.set()
        self.calls.append(time.monotonic())
        time.sleep(self.check_s)
        self.in_flight.clear()
        return False


def test_the_exit_stops_the_poll_and_waits_for_the_call_in_flight():
    store = SlowStore(check_s=0.5)
    listener = Listener(store, "abort")
    assert store.in_flight.wait(10.0)  # the first poll is in the store's call
    t0 = time.monotonic()
    listener._join_at_exit()  # what atexit runs, before the interpreter finalizes
    joined_s, calls = time.monotonic() - t0, len(store.calls)
    time.sleep(0.4)  # past the poll's first interval (0.1 s)
    print(f"\nthe exit waited {joined_s:.2f} s for the call in flight; thread alive: "
          f"{listener._thread.is_alive()}; store calls {calls}, then {len(store.calls)}")
    assert not listener._thread.is_alive() and not store.in_flight.is_set()
    assert len(store.calls) == calls == 1 and joined_s < 5.0
    assert listener.message is None  # nothing heard: the exit is not a failure


def test_a_sleeping_poll_ends_at_once_at_the_exit():
    store = SlowStore(check_s=0.0)
    listener = Listener(store, "abort")
    while len(store.calls) < 3:  # sleeping between polls, the interval grown past 0.1 s
        time.sleep(0.05)
    t0 = time.monotonic()
    listener._join_at_exit()
    print(f"\nthe exit ended the poll in {time.monotonic() - t0:.3f} s after {len(store.calls)} calls")
    assert not listener._thread.is_alive() and time.monotonic() - t0 < 1.0

"""The abort signal's cost on the rendezvous store, and how soon a waiting rank hears it.

Two gloo ranks; rank 1 waits for a receive that rank 0 never sends, on the host (gloo) or as an
emulated stream wait under the iteration's watchdog (``executor.stream_emulation``); after
``WAIT_S`` rank 0 signals a failure. Every store request the abort machinery makes goes through
a counting TCPStore client. Polling the key every 0.1 s (before: ``failure()`` read the store)
cost ~10 requests per second per waiting rank, 40,960 per second at 4,096 ranks on the store
NCCL's communicator creation also uses; a listener blocked on the store costs its connection and
one WAIT per ``REARM_S``.
"""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from harness.workers import run_workers

WAIT_S = 3.0
RANKS_AT_SCALE = 4096


def _counting_store(host: str, port: int):
    """A TCPStore client that counts every request made through it (and through its clones)."""
    counts = {"requests": 0, "times": []}

    def counted(method):
        def call(self, *a):
            counts["requests"] += 1
            counts["times"].append(time.time())
            return method(self, *a)
        return call

    class Counting(dist.TCPStore):
        def clone(self):
            counted(lambda s: None)(self)  # a connection
            return Counting(host, port, is_master=False, wait_for_workers=False)

    for name in ("check", "get", "set", "compare_set", "wait"):
        setattr(Counting, name, counted(getattr(dist.TCPStore, name)))

    return Counting(host, port, is_master=False, wait_for_workers=False), counts


def _worker(rank, world, port, on_host, agent_store=True):
    from megatron_dualpipe.executor import abort, stream_emulation

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    # what the listener reads: the store is torchrun's agent's (outlives the ranks) or rank 0's
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(agent_store)
    store, counts = _counting_store("127.0.0.1", port)
    abort._store = lambda: store
    if hasattr(abort, "listener"):
        abort.listener()  # started with the process group, as the first wait would
    time.sleep(0.5)
    base = counts["requests"]
    if rank == 0:
        time.sleep(WAIT_S)
        signalled = time.time()
        abort.signal("RuntimeError: rank 0 failed on purpose")
        store.wait(["rank1 done"], datetime.timedelta(seconds=60))
        return {"signalled": signalled, "requests": counts["requests"] - base}
    start, started = time.monotonic(), time.time()
    try:
        with stream_emulation.emulate_nccl(deadline_s=60) if not on_host else _nothing():
            _wait_for_rank0(abort, on_host)
        kind, msg = "finished", ""
    except Exception as e:  # noqa: BLE001 - reported
        kind, msg = type(e).__name__, str(e)
    waited, stopped = time.monotonic() - start, time.time()
    times = [t for t in counts["times"] if t >= started]
    store.set("rank1 done", "1")
    return {"kind": kind, "msg": msg, "stopped": stopped, "waited": waited, "started": started, "times": times}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _wait_for_rank0(abort, on_host):
    what = "global rank 1: the receive of a tensor from global rank 0"
    if on_host:
        abort.wait_work(dist.irecv(torch.zeros(1), 0), 600, what)
        return
    from megatron_dualpipe.executor import watchdog

    with watchdog.watching(600):
        abort.wait_work(dist.irecv(torch.zeros(1), 0), 600, what, on_host=False)


@pytest.mark.parametrize("on_host", [True, False], ids=["host wait", "emulated stream wait"])
def test_a_waiting_rank_hears_a_failure_without_polling_the_store(on_host):
    r0, r1 = run_workers(_worker, 2, args=(on_host,), timeout=120)
    quiet_s = r0["signalled"] - r1["started"]
    before = sum(1 for t in r1["times"] if t < r0["signalled"])
    rate = before / quiet_s
    print(f"\n{'host wait' if on_host else 'emulated stream wait'}: rank 1 {r1['kind']} after {r1['waited']:.2f} s, "
          f"{r1['stopped'] - r0['signalled']:.3f} s after rank 0 signalled: {r1['msg'][:200]}")
    print(f"  rank 1's store requests: {before} in the {quiet_s:.2f} s it waited before the signal ({rate:.2f} per "
          f"second; at {RANKS_AT_SCALE} ranks {rate * RANKS_AT_SCALE:,.0f} per second), "
          f"{len(r1['times']) - before} after it (reading the message); rank 0: {r0['requests']} (its signal and "
          f"its wait for rank 1)")
    assert r1["kind"] == "PeerFailedError", r1
    assert "because global rank 0 failed: RuntimeError: rank 0 failed on purpose" in r1["msg"], r1
    assert "global rank 1" in r1["msg"] and "global rank 0" in r1["msg"], r1
    assert r1["stopped"] - r0["signalled"] < 2.0, (r0, r1)
    assert rate < 1.0, f"{before} store requests in {quiet_s:.1f} s"


def test_a_store_that_rank_0_hosts_is_polled_with_a_backoff():
    """Without torchrun's agent (srun, mpirun) rank 0 hosts the store and takes it along when it
    exits: no wait may be blocked on it then (tests/megatron_lm/test_preloaded_launch.py shows the
    exit), so the listener polls, the interval doubling to BACKOFF_S[1]: a few requests in the first
    seconds, then one per BACKOFF_S[1]; the failure is heard within that interval."""
    from megatron_dualpipe.executor.abort_listener import BACKOFF_S

    r0, r1 = run_workers(_worker, 2, args=(True, False), timeout=120)
    quiet_s = r0["signalled"] - r1["started"]
    before = sum(1 for t in r1["times"] if t < r0["signalled"])
    late = r1["stopped"] - r0["signalled"]
    print(f"\nrank 0 hosting the store: rank 1 {r1['kind']} {late:.3f} s after rank 0 signalled; {before} store "
          f"requests in the {quiet_s:.2f} s before (then one per {BACKOFF_S[1]} s: at {RANKS_AT_SCALE} ranks "
          f"{RANKS_AT_SCALE / BACKOFF_S[1]:,.0f} per second)")
    assert r1["kind"] == "PeerFailedError" and "rank 0 failed on purpose" in r1["msg"], r1
    assert late < BACKOFF_S[1] + 1.0, (r0, r1)
    doublings = 1 + sum(1 for k in range(20) if BACKOFF_S[0] * (2 ** k - 1) < quiet_s + 1.0)
    assert before <= doublings, f"{before} store requests in {quiet_s:.1f} s"


def _between_worker(rank, world, port):
    """Both ranks run one watched iteration with an emulated stream wait; then rank 1 waits, outside
    any iteration, on an all-reduce rank 0 never joins (as Megatron's grad-norm all-reduce in the
    optimizer step waits for a rank that failed); rank 0 signals a failure after WAIT_S."""
    from megatron_dualpipe.executor import abort, stream_emulation, watchdog

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    store = dist.distributed_c10d._get_default_store()
    with stream_emulation.emulate_nccl(deadline_s=60):
        with watchdog.watching(600):
            abort.wait_work(dist.all_reduce(torch.ones(1), async_op=True), 600, f"global rank {rank}: the warm-up",
                            on_host=False)
        if rank == 0:
            time.sleep(WAIT_S)
            signalled = time.time()
            abort.signal("RuntimeError: rank 0 failed in its optimizer step")
            store.wait(["rank1 done"], datetime.timedelta(seconds=60))
            return {"signalled": signalled}
        try:
            dist.all_reduce(torch.ones(1), async_op=True).wait()  # Megatron's own wait: no watchdog of ours
            kind = "finished"
        except Exception as e:  # noqa: BLE001 - reported
            kind = type(e).__name__
    stopped = time.time()
    store.set("rank1 done", "1")
    return {"kind": kind, "stopped": stopped}


def test_a_failure_between_iterations_aborts_the_communicators_on_an_accelerator():
    """Outside an iteration no watchdog of ours runs; once a process has waited on a stream, the
    listener aborts its communicators itself when it hears a failure, so that a host sync in
    Megatron's own code raises (NCCL: an error naming no peer; the log line names the failure)
    instead of waiting for NCCL's timeout."""
    r0, r1 = run_workers(_between_worker, 2, timeout=120)
    delay = r1["stopped"] - r0["signalled"]
    print(f"\nrank 1, waiting in a collective outside any iteration: {r1['kind']} {delay:.3f} s after rank 0 signalled")
    assert r1["kind"] == "EmulatedCommunicatorAborted", r1
    assert 0 <= delay < 2.0, (r0, r1)


def _late_error_worker(rank, world, port):
    """Rank 0 signals a failure; rank 1 then raises a connection error of its own (as gloo's
    'Connection closed by peer' when a stopped peer exits) before its listener heard: the listener
    is replaced by one that never hears, so only the store's kept failure can name rank 0."""
    from megatron_dualpipe.executor import abort

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        abort.signal("RuntimeError: rank 0 failed first")
        store.set("rank0 signalled", "1")
        store.wait(["rank1 done"], datetime.timedelta(seconds=60))
        return None
    store.wait(["rank0 signalled"], datetime.timedelta(seconds=60))
    deaf = abort.Listener.__new__(abort.Listener)
    deaf.store, deaf.key, deaf.message, deaf._on_heard = abort.base_store(store), abort.KEY, None, []
    deaf._lock = __import__("threading").Lock()
    abort._LISTENING[:] = [dist.distributed_c10d._get_default_group(), deaf]
    errors = []
    for error in (RuntimeError("Connection closed by peer"), ValueError("this rank's own bug")):
        try:
            with abort.signalling_failure():
                raise error
        except Exception as e:  # noqa: BLE001 - reported
            errors.append((type(e).__name__, str(e), type(e.__cause__).__name__))
    store.set("rank1 done", "1")
    return errors


def test_an_error_after_a_peer_signalled_names_that_peer():
    """An error raised after another rank signalled (a connection that rank's exit closed, before
    this rank's listener heard) becomes the PeerFailedError naming that rank, its own error chained;
    the signal kept is the first, so every later error of this rank names rank 0 too."""
    _, errors = run_workers(_late_error_worker, 2, timeout=120)
    for kind, msg, cause in errors:
        print(f"\nrank 1: {kind}: {msg} (from {cause})")
    assert [e[0] for e in errors] == ["PeerFailedError", "PeerFailedError"], errors
    assert all("because global rank 0 failed: RuntimeError: rank 0 failed first" in e[1] for e in errors), errors
    assert errors[0][1].startswith("global rank 1 stopped (RuntimeError: Connection closed by peer)"), errors
    assert [e[2] for e in errors] == ["RuntimeError", "ValueError"], errors

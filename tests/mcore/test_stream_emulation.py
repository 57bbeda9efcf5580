"""The accelerator branches on the CPU: the executor, GradReduction and the loss gather under an
emulation of NCCL's stream semantics (``executor.stream_emulation``).

Under ``emulate_nccl`` CPU tensors take every "on an accelerator" branch of the package
(``executor.streams.waits_order_stream``), and gloo's works behave like NCCL's: a batch
completes with all its operations, ``is_completed()`` turns True by itself, and ``wait()`` is a
stream wait that stops the rank until the operation completed (at most a deadline, then
``EmulatedStreamDeadlock`` names what the stream waited for).

Issue 17: GradReduction waited for each bd sum right after issuing it; on a GPU that stalled
the stream, and with pp=2 and an odd number of micro-batches the partner first needed a tensor
queued behind the stall. With e32f1b8's grads.py (its accelerator test forced on) this test's
M=3 case ends in ``EmulatedStreamDeadlock`` / ``P2PTimeoutError``; now every case equals the
single-process reference, as the gloo path does (``test_dualpipe_megatron``).
"""
from __future__ import annotations

import re
import time

import pytest
import torch

import test_dualpipe_megatron as tdm
from harness import megatron_env as me

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")

DEADLINE_S = 20.0


def _emulated_pipeline_worker(rank, world, port, *args):
    from megatron_dualpipe.executor import stream_emulation as se

    with se.emulate_nccl(deadline_s=DEADLINE_S):
        results = tdm._pipeline_worker(rank, world, port, *args)
    results[0]["emulated"] = dict(se.STATS)
    return results


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_odd_microbatches_dp2_overlap_grad_reduce_under_nccl_stream_semantics(schedule):
    """pp=2, dp=2, --overlap-grad-reduce (Megatron DDP, grad_sync_func), tied embeddings, M=3
    (odd, pp <= M < 2pp: padded, the partners finish their chunks at different points), with and
    without zero bubble, then M=4; forward-only M=3 (the loss gather alone)."""
    pp, dp = 2, 2
    runs = [(3, True, False), (3, False, False), (4, True, False), (3, True, True)]
    state, refs = tdm._references(True, 4, dp)
    t0 = time.monotonic()
    results = me.run_workers(_emulated_pipeline_worker, pp * dp, args=(schedule, True, state, runs, dp, False, True),
                             timeout=300)
    label = f"{schedule} pp={pp} dp={dp} overlap_grad_reduce, emulated NCCL streams"
    print(f"\n{label} ({time.monotonic() - t0:.1f} s):")
    for res in results:
        stats = res[0]["emulated"]
        print(f"  rank (dp {res[0]['dp']}, pp {res[0]['pp']}): {stats['works']} emulated NCCL works, "
              f"{stats['stream_waits']} stream waits")
        assert stats["works"] > 0 and stats["stream_waits"] > 0, stats  # the accelerator branches ran
    tdm._check(label, results, refs, runs, pp * dp, dp)


# -- a rank that raises: how soon every peer stops, under emulated NCCL streams -------------------------

#: Where the failing rank raises: (global rank that fails, what it raises in).
FAILURES = {
    "bd sum": 2,           # pipeline rank 1 of replica 0, instead of issuing its first bd sum (partner: global 0)
    "dp reduction": 1,     # pipeline rank 0 of replica 1, instead of starting its first data-parallel reduction
    "loss gather": 0,      # pipeline rank 0 of replica 0, instead of sending direction 1's losses to global 2
}


def _inject(where: str, failed_at: list) -> None:
    """Make this rank raise where ``where`` says, recording the wall-clock time of the raise."""
    from megatron_dualpipe.executor import pair_sums
    from megatron_dualpipe.mcore import grad_reduction, loss_gather

    def fail(*_a, **_k):
        failed_at.append(time.time())
        raise RuntimeError(f"injected: this rank fails in its {where}")

    if where == "bd sum":
        pair_sums.issue_sum = fail
    elif where == "loss gather":
        loss_gather._send_entries = fail
    else:
        starts = grad_reduction._dp_start_functions
        grad_reduction._dp_start_functions = lambda config, model: [fail if f else f for f in starts(config, model)]


def _failing_worker(rank, world, port, where, flag_dir, *args):
    """One iteration in which global rank ``FAILURES[where]`` raises; every rank returns (error type,
    message, wall-clock time it stopped, the failing rank's raise time). Every rank stays alive until
    all have reported: an exit (the failing rank's, or a peer's that stopped first and hosts the store)
    would close the others' connections before their listeners heard: not the path measured."""
    import os

    from megatron_dualpipe.executor import stream_emulation as se

    failed_at: list = []
    if rank == FAILURES[where]:
        _inject(where, failed_at)
    try:
        with se.emulate_nccl(deadline_s=DEADLINE_S):
            tdm._pipeline_worker(rank, world, port, *args)
        result = ("finished", "", time.time(), None)
    except Exception as e:  # noqa: BLE001 - reported to the test
        result = (type(e).__name__, str(e), time.time(), failed_at[0] if failed_at else None)
    open(os.path.join(flag_dir, f"rank{rank}"), "w").close()
    end = time.monotonic() + 60
    while len(os.listdir(flag_dir)) < world and time.monotonic() < end:
        time.sleep(0.05)
    return result


@pytest.mark.parametrize("where", list(FAILURES))
def test_a_rank_raising_stops_every_peer_with_a_named_error_under_nccl_stream_semantics(where, tmp_path):
    """dualpipe pp=2 dp=2 --overlap-grad-reduce, two iterations of M=4, emulated NCCL streams (no
    host deadline): one rank raises in the first iteration's bd sum, data-parallel reduction or loss
    gather. Every other rank stops with PeerFailedError naming the failing rank and what it waited
    for (a rank whose first iteration needs nothing of the failing one, as the other replica's
    loss gather, stops before its second), within seconds:
    before the watchdog, the stream waits held them until the emulation's deadline (20 s; on a
    GPU NCCL's 10 minutes), naming no peer. Prints each rank's delay after the raise."""
    failing = FAILURES[where]
    state, _ = tdm._references(True, 4, 2)
    results = me.run_workers(_failing_worker, 4, args=(where, str(tmp_path), "dualpipe", True, state,
                                                       [(4, True, False)] * 2, 2, False, True), timeout=200)
    raised_at = results[failing][3]
    assert raised_at is not None, results[failing]
    print(f"\n{where}: global rank {failing} raised")
    delays = {}
    for rank, (kind, msg, stopped, _) in enumerate(results):
        delays[rank] = stopped - raised_at
        print(f"  global rank {rank}: {kind} after {delays[rank]:.3f} s: {msg[:300]}")
    assert results[failing][0] == "RuntimeError" and "injected" in results[failing][1], results[failing]
    peers = [r for r in range(4) if r != failing]
    for r in peers:
        kind, msg = results[r][:2]
        assert kind == "PeerFailedError", (r, kind, msg)
        assert f"because global rank {failing} failed: RuntimeError: injected" in msg, (r, msg)
        assert re.search(rf"global rank {r}\b|\(global {r}\)", msg), (r, msg)  # names itself
    last = max(delays[r] for r in peers)
    print(f"  the last peer stopped {last:.3f} s after the raise (emulated stream deadline {DEADLINE_S:g} s)")
    assert last < DEADLINE_S / 4, delays

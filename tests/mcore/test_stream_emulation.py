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

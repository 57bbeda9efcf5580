"""Benchmark: what the executor itself costs, apart from the model.

Prints, for each schedule, (1) the time to build and check the schedule and its communication
plan (done once, then cached), and (2) the executor's time per action when the compute is a
no-op on tiny tensors, over gloo with pp processes on this machine: Python bookkeeping plus one
batched P2P per unit. Figures only; nothing is asserted.

    python tools/bench_executor.py [--pp 4] [--microbatches 32] [--iters 5]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron_dualpipe.bench.launch import spawn  # noqa: E402
from megatron_dualpipe.executor.p2p import P2P  # noqa: E402
from megatron_dualpipe.executor.runner import TensorSpec, run_rank  # noqa: E402
from megatron_dualpipe.schedule.lowering.program import build_program  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1", "dualpipe", "dualpipev")


class NoCompute:
    def __init__(self, spec):
        self.out = torch.zeros(spec.shape, device=spec.device)

    def forward(self, a, inp):
        return self.out.clone()

    def backward(self, a, grad):
        return self.out.clone()

    def weight(self, a):
        pass

    def release(self, a, out):
        pass


def worker(rank, world, device, m, iters):
    """One pipeline rank (``bench.launch`` has joined the process group)."""
    spec = TensorSpec((16, 2, 8), torch.float32, device)
    out = {}
    for name in SCHEDULES:
        prog = build_program(name, world, m)
        p2p = P2P(None, list(range(world)), rank, timeout_s=60)
        run_rank(prog, rank, NoCompute(spec), p2p, spec)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            run_rank(prog, rank, NoCompute(spec), p2p, spec)
        dist.barrier()
        out[name] = ((time.perf_counter() - t0) / iters, len(prog.actions[rank]),
                     len(prog.plans[rank].batches))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=32)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)

    print("schedule build + communication-plan check (once per (schedule, pp, M), then cached):")
    print(f"{'schedule':>10} {'pp':>3} {'M':>4} {'ms':>9}")
    for name in SCHEDULES:
        for pp in (4, 8, 16):
            m = 4 * pp
            build_program.cache_clear()
            t0 = time.perf_counter()
            build_program(name, pp, m)
            print(f"{name:>10} {pp:>3} {m:>4} {(time.perf_counter() - t0) * 1e3:9.1f}")

    results = spawn(worker, args.pp, args=(args.microbatches, args.iters), timeout_s=600)
    print(f"\nexecutor overhead with a no-op model, pp={args.pp}, M={args.microbatches}, gloo on this machine "
          f"({os.cpu_count()} cores), mean over {args.iters} iterations, slowest rank:")
    print(f"{'schedule':>10} {'actions/rank':>13} {'P2P batches':>12} {'ms/iteration':>13} {'us/action':>10}")
    for name in SCHEDULES:
        secs = max(r[name][0] for r in results)
        acts = max(r[name][1] for r in results)
        batches = max(r[name][2] for r in results)
        print(f"{name:>10} {acts:>13} {batches:>12} {secs * 1e3:13.1f} {secs / acts * 1e6:10.0f}")


if __name__ == "__main__":
    main()

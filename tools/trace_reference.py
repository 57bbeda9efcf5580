"""Trace DeepSeek's reference DualPipe / DualPipeV ``step()`` into our action format.

This runs the reference's own control flow (its ``step()``, ``_forward_chunk``,
``_backward_chunk``, ``_forward_backward_chunk``, ``_weight_chunk`` and its FIFO
``WeightGradStore``) for every rank in one process, with the compute and communication
primitives replaced by recorders. Nothing of the reference is copied into this project: point
``--ref`` at a checkout of github.com/deepseek-ai/DualPipe.

    python tools/trace_reference.py --ref /path/to/DualPipe --out tests/data/reference_schedules.json

The output maps "dualpipe/pp/M" to the per-rank short-form action lists (``str(Action)``), which
``tests/schedule/test_reference_order.py`` compares with our generators. ``trace()`` also returns each
rank's sequence of communication calls, for studying the reference's send/receive order.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import types

import torch


def _load(ref: str):
    sys.path.insert(0, ref)
    try:
        mod = {
            "dualpipe": importlib.import_module("dualpipe.dualpipe"),
            "dualpipev": importlib.import_module("dualpipe.dualpipev"),
        }
        return mod, importlib.import_module("dualpipe.utils"), importlib.import_module("dualpipe.comm")
    finally:
        sys.path.pop(0)


def trace(ref: str, name: str, pp: int, m: int):
    mods, utils, comm = _load(ref)
    comm.TENSOR_SHAPES, comm.TENSOR_DTYPE = [(1,)], "float32"
    cls = getattr(mods[name], "DualPipe" if name == "dualpipe" else "DualPipeV")
    ranks, comms = [], []
    for rank in range(pp):
        self = object.__new__(cls)  # skip __init__: it needs CUDA and a process group
        object.__setattr__(self, "_modules", {})
        self.rank, self.num_ranks, self.batch_dim = rank, pp, 0
        self.is_first_rank, self.is_last_rank = rank == 0, rank == pp - 1
        self.is_in_second_half = rank >= pp // 2
        self.is_middle_rank = rank in (pp // 2 - 1, pp // 2)
        second_half = self.is_in_second_half if name == "dualpipe" else False
        acts, events = [], []
        counters = {"F": [0, 0], "B": [0, 0]}

        def stage(d):
            if name == "dualpipe":
                return rank if d == 0 else pp - 1 - rank
            return rank if d == 0 else 2 * pp - 1 - rank

        def fwd(phase, overlap=False):
            d = phase ^ second_half
            acts.append(f"F{d}.{counters['F'][d]}{'+' if overlap else ''}")
            counters["F"][d] += 1

        def bwd(phase, enable_zb=False):
            d = phase ^ second_half
            mb = counters["B"][d]
            counters["B"][d] += 1
            if enable_zb:
                acts.append(f"B{d}.{mb}")
                utils.WeightGradStore.put(lambda d=d, mb=mb: acts.append(f"W{d}.{mb}"))
                utils.WeightGradStore.flush()
            else:
                acts.append(f"BW{d}.{mb}")

        def fwd_bwd(phase0, phase1):
            fwd(phase0, overlap=True)
            bwd(phase1)

        def comm_recorder(kind):
            def rec(self_, phase):
                events.append(f"{kind}{phase ^ second_half}")
            return rec

        self._forward_compute_chunk = fwd
        self._backward_compute_chunk = lambda phase, enable_zb=False: bwd(phase, enable_zb)
        self._forward_backward_compute_chunk = fwd_bwd
        self._commit_and_wait_comm = lambda: events.append("commit")
        for kind in ("recv_forward", "send_forward", "recv_backward", "send_backward"):
            setattr(self, f"_{kind}", types.MethodType(comm_recorder(kind), self))
        def reset(self_=self):
            utils.WeightGradStore.clear()
            self_.loss_chunks = [torch.zeros(1)]  # read by step()'s epilogue only

        self._reset_states = reset
        self.step(num_chunks=m, criterion=(lambda *a: None))
        ranks.append(acts)
        comms.append(events)
    return ranks, comms


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", required=True, help="checkout of github.com/deepseek-ai/DualPipe")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = {}
    for pp in range(2, 17, 2):
        for m in sorted({2 * pp, 2 * pp + 2, 3 * pp + (3 * pp) % 2, 4 * pp + 6}):
            for name in ("dualpipe", "dualpipev"):
                ranks, comms = trace(args.ref, name, pp, m)
                out[f"{name}/{pp}/{m}"] = [" ".join(r) for r in ranks]
    for name, pp, m in (("dualpipev", 3, 6), ("dualpipev", 5, 13), ("dualpipev", 1, 2)):
        ranks, comms = trace(args.ref, name, pp, m)
        out[f"{name}/{pp}/{m}"] = [" ".join(r) for r in ranks]
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
    print(f"wrote {len(out)} traced schedules to {args.out}")


if __name__ == "__main__":
    main()

"""The crossover table of docs/benchmarks.md: which schedule the model picks for dense GPTs of
several sizes, pipeline sizes, micro-batch counts and inter-node bandwidths, gradient
communication included (``costs.comm_cost``), Megatron's interleaved 1F1B among them.

    python tools/crossover_table.py            # markdown on stdout

Stated inputs (H800-class): 400 TFLOP/s sustained per GPU, 8 GPUs per node, 200 GB/s per GPU
inside a node, Megatron's rank placement, fp32 main gradients, the data-parallel all-reduce of
each chunk started when it is final (--overlap-grad-reduce), dp=4.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dualpipe.costs.advice import DenseModel  # noqa: E402
from megatron_dualpipe.costs.comm_cost import CommModel, Link, Network, Placement  # noqa: E402
from megatron_dualpipe.costs.compare import run  # noqa: E402
from megatron_dualpipe.schedule.registry import (DUALPIPE, DUALPIPEV, INTERLEAVED_1F1B, ONE_F_ONE_B,  # noqa: E402
                                                 ZB_H1)

MODELS = (("1.3B", 1.3e9, 2048, 2048, 1), ("7B", 7e9, 4096, 4096, 1), ("13B", 13e9, 5120, 4096, 2),
          ("70B", 70e9, 8192, 4096, 8))
PPS = (8, 16)
PER_PP = (2, 4)
BANDWIDTHS = (12.5, 25.0, 50.0, 100.0)
DP = 4
NAMES = (ONE_F_ONE_B, ZB_H1, DUALPIPE, DUALPIPEV, INTERLEAVED_1F1B)
SHORT = {ONE_F_ONE_B: "1F1B", ZB_H1: "ZB-H1", DUALPIPE: "DualPipe", DUALPIPEV: "DualPipeV",
         INTERLEAVED_1F1B: "interleaved"}


def cell(model: DenseModel, tp: int, m: int, bw: float) -> str:
    comm = CommModel(Placement(model.pp, DP, tp), Network(Link(200, 0.01), Link(bw, 0.02)),
                     model.stage_grad_bytes, model.message_bytes)
    rows = {n: run(n, model.pp, m, model.costs, comm=comm) for n in NAMES}
    best = min(rows, key=lambda n: rows[n].iteration)
    dp_ratio = rows[DUALPIPE].iteration / rows[ONE_F_ONE_B].iteration
    return f"{SHORT[best]} ({dp_ratio:.2f})"


def main() -> None:
    print("| model | tp | pp | M | GPUs | " + " | ".join(f"{bw:g} GB/s" for bw in BANDWIDTHS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(BANDWIDTHS))
    for label, params, hidden, tokens, tp in MODELS:
        for pp in PPS:
            model = DenseModel(params, hidden, tokens, pp, 400.0, tp)
            for k in PER_PP:
                m = k * pp
                cells = [cell(model, tp, m, bw) for bw in BANDWIDTHS]
                print(f"| {label} | {tp} | {pp} | {m} | {pp * DP * tp} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""Stage ``memory``: each rank's peak activation memory under 1F1B, DualPipe and DualPipeV (the live
bytes of the distinct storages autograd saved, on every backend) against the simulator's prediction
and ``advise``'s; on a GPU also the peak allocated memory, reported only (it holds temporaries).
Soft: a rank above :data:`OVER` times the prediction FAILs without stopping the selftest.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Iterator, List

import torch

from ..costs.advice import advise
from ..proof import models
from .result import FAIL, PASS, StageResult
from ..schedule import build_schedule
from ..schedule.registry import ONE_F_ONE_B
from ..schedule.simulate import Costs, simulate

NAME = "memory"
OVER = 1.10
_MIB = float(1 << 20)


class SavedBytes:
    """Live bytes of the distinct storages autograd saved while :meth:`counting`, parameters excluded."""

    def __init__(self, exclude: set):
        self.exclude = exclude
        self.live: Dict[int, List[int]] = {}  # storage address -> [tensors alive, bytes]
        self.bytes = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr, n = storage.data_ptr(), storage.nbytes()
        if ptr in self.exclude or n == 0:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = entry = [0, n]
            self.bytes += n
            self.peak = max(self.peak, self.bytes)
        entry[0] += 1
        weakref.finalize(t, self._release, ptr)
        return t

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[ptr]

    @contextlib.contextmanager
    def counting(self) -> Iterator["SavedBytes"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


def _params(chunks) -> set:
    return {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}


def forward_saved_bytes(spec: models.ModelSpec, chunk, batch: dict) -> int:
    """What one forward of ``chunk`` saves for backward (its input made up when it has no embedding)."""
    counter = SavedBytes(_params([chunk]))
    if not chunk.pre_process:
        chunk.set_input_tensor(torch.zeros(spec.seq, spec.mbs, spec.hidden, dtype=spec.torch_dtype,
                                           device=batch["tokens"].device, requires_grad=True))
    pre, post = chunk.pre_process, chunk.post_process
    with counter.counting():  # the peak stays when the output (and what it saved) is freed
        chunk(batch["tokens"] if pre else None, batch["position_ids"] if pre else None, None,
              labels=batch["labels"] if post else None)
    return counter.peak


def run(ctx) -> dict:
    spec = ctx.cfg.spec()
    full = models.full_state_dict(spec)
    out = {"coord": ctx.coord, "rank": ctx.rank, "schedules": {}}
    cuda = ctx.device.type == "cuda"
    for schedule in models.SCHEDULES:
        chunks = models.build(spec, schedule, full)
        micro = models.batches(spec, 2 * ctx.cfg.pp, step=3)
        per_forward = [forward_saved_bytes(spec, c, micro[0]) for c in chunks]
        models.zero_grads(chunks)
        counter = SavedBytes(_params(chunks))
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        with counter.counting():
            models.run_iteration(spec, schedule, chunks, micro, p2p_timeout=ctx.cfg.deadline_s)
        allocated = (torch.cuda.max_memory_allocated() - before) if cuda else None
        params = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
        out["schedules"][schedule] = {"saved_peak": counter.peak, "per_forward": per_forward,
                                      "allocated_peak": allocated, "parameter_bytes": params}
        del chunks
    return out


def _advise_activations(pp: int, m: int, per_forward: float) -> Dict[str, float]:
    """``advise``'s activation memory (MiB, busiest rank) per schedule, from one 1F1B stage's forward."""
    advice = advise(pp, [m], Costs(f=1, b=2, w=1), activation_memory=per_forward / _MIB, parameter_memory=0.0,
                    names=list(models.SCHEDULES))
    return {o.row.name: o.activation_memory for o in advice.choices[0].options if not o.row.problem}


def judge(ctx, payloads: List[dict]) -> StageResult:
    pp, m = ctx.cfg.pp, 2 * ctx.cfg.pp
    pipeline = sorted((p for p in payloads if tuple(p["coord"])[1:] == (0, 0)), key=lambda p: p["coord"][0])
    details = [f"M={m}; measured: peak live bytes autograd saved (distinct storages, parameters excluded); "
               f"predicted: simulated peak live activations of the rank x one forward of its larger chunk"]
    failures, numbers, parts = [], {}, []
    # advise takes one micro-batch's activations on one stage as 1F1B runs it (a DualPipeV chunk: half)
    stage_bytes = max(max(p["schedules"][ONE_F_ONE_B]["per_forward"]) for p in pipeline)
    advised = _advise_activations(pp, m, stage_bytes)
    for schedule in models.SCHEDULES:
        s = build_schedule(schedule, pp, m)
        peaks = simulate(s.layout, s.ranks).peak_activations
        rows, worst = [], 0.0
        for p in pipeline:
            r = p["coord"][0]
            got = p["schedules"][schedule]
            predicted = peaks[r] * max(got["per_forward"])
            ratio = got["saved_peak"] / predicted if predicted else float("nan")
            worst = max(worst, ratio)
            alloc = "" if got["allocated_peak"] is None else f", allocated +{got['allocated_peak'] / _MIB:.1f} MiB"
            rows.append(f"  rank {r}: {got['saved_peak'] / _MIB:.3f} MiB saved vs {predicted / _MIB:.3f} predicted "
                        f"({peaks[r]} x {max(got['per_forward']) / _MIB:.3f}): {ratio:.2f}x{alloc}; parameters "
                        f"{got['parameter_bytes'] / _MIB:.3f} MiB")
            if ratio > OVER:
                failures.append(f"{schedule} rank {r} holds {ratio:.2f}x the predicted activations")
        adv = advised.get(schedule)
        measured_max = max(p["schedules"][schedule]["saved_peak"] for p in pipeline) / _MIB
        details.append(f"{schedule}: busiest rank {measured_max:.3f} MiB; advise predicts "
                       f"{'-' if adv is None else f'{adv:.3f}'} MiB for its busiest rank")
        details += rows
        numbers[schedule] = {"measured_max_mib": measured_max, "advise_mib": adv, "worst_ratio": worst}
        parts.append(f"{schedule} {measured_max:.2f} MiB ({worst:.2f}x predicted at worst)")
    summary = "activations saved, busiest rank: " + ", ".join(parts)
    if failures:
        return StageResult(NAME, FAIL, f"{failures[0]}; {summary}", failures + details, numbers, hard=False)
    return StageResult(NAME, PASS, summary, details, numbers)

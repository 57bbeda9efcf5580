"""Stage ``equality``: the tiny GPT (and, with ``--ep``, a tiny MoE over expert parallelism) from
the same weights under Megatron's own 1F1B, DualPipe and DualPipeV, on the same micro-batches:

* every micro-batch's loss, and every parameter's gradient, within the dtype's tolerance of
  1F1B's (``options.TOLERANCE``; relative to the largest |value| of the tensor);
* after a few SGD steps with DualPipe, the two copies of every stage (model[0] on rank i,
  model[1] on rank pp-1-i) are bit-identical.

The reference is Megatron's own schedule, on the user's layers (local or Transformer Engine), the
user's backend and devices: what the CPU tests prove against a single process, proven here.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch

from . import models
from .result import FAIL, PASS, StageResult
from ..schedule.registry import DUALPIPE, DUALPIPEV, ONE_F_ONE_B

NAME = "equality"
STEPS, LR = 3, 0.1


def _one_model(ctx, spec: models.ModelSpec) -> dict:
    m = 2 * ctx.cfg.pp
    full = models.full_state_dict(spec)
    losses, grads = {}, {}
    for schedule in models.SCHEDULES:
        chunks = models.build(spec, schedule, full)
        micro = models.batches(spec, m)
        if schedule != ONE_F_ONE_B:
            micro = models.faulty(micro)
        losses[schedule] = models.run_iteration(spec, schedule, chunks, micro, p2p_timeout=ctx.cfg.deadline_s)
        grads[schedule] = models.grads_by_full_name(chunks, full)
        if schedule == DUALPIPE:
            copies = _train_steps(ctx, spec, chunks, full)
    return {"losses": losses, "grads": grads, "copies": copies}


def _train_steps(ctx, spec, chunks, full) -> List[Dict[str, np.ndarray]]:
    """A few SGD steps with DualPipe (from the gradients just computed); each chunk's parameters."""
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=LR)
    for step in range(STEPS):
        if step:
            models.zero_grads(chunks)
            models.run_iteration(spec, DUALPIPE, chunks, models.batches(spec, 2 * ctx.cfg.pp, step),
                                 p2p_timeout=ctx.cfg.deadline_s)
        opt.step()
    out = []
    from . import tiny_gpt

    for chunk in chunks:
        offset = tiny_gpt.layer_offset(chunk)
        out.append({tiny_gpt.full_key(n, offset, full): p.detach().cpu().float().numpy()
                    for n, p in chunk.named_parameters()})
    return out


def run(ctx) -> dict:
    out = {"coord": ctx.coord, "models": {"GPT": _one_model(ctx, ctx.cfg.spec())}}
    if ctx.cfg.ep > 1:
        out["models"]["MoE"] = _one_model(ctx, ctx.cfg.spec(moe=True))
    return out


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    diff = float(np.max(np.abs(got - want))) if want.size else 0.0
    return diff / scale if scale > 0 else diff


def _compare_model(ctx, name: str, payloads: List[dict], tol: float) -> Tuple[List[str], List[str], dict]:
    """(details, failures, numbers) for one model."""
    pp = ctx.cfg.pp
    details, failures, numbers = [], [], {}
    by_coord = {tuple(p["coord"]): p["models"][name] for p in payloads}
    # Megatron 1F1B's gradient of every parameter: (tp, dp, full name) -> array
    ref: Dict[tuple, np.ndarray] = {}
    for (pp_rank, tp, dp), p in by_coord.items():
        for key, g in p["grads"][ONE_F_ONE_B][0].items():
            ref[(tp, dp, key)] = g
    for schedule in (DUALPIPE, DUALPIPEV):
        worst_loss, worst_grad, where = 0.0, 0.0, ""
        missing = []
        for (pp_rank, tp, dp), p in sorted(by_coord.items()):
            if pp_rank == pp - 1:
                want, got = p["losses"][ONE_F_ONE_B], p["losses"][schedule]
                if got is None or len(got) != len(want):
                    failures.append(f"{name} {schedule}: the last rank returned {got} losses, 1F1B {len(want)}")
                    continue
                for k, (a, b) in enumerate(zip(got, want)):
                    d = abs(a - b) / max(abs(b), 1e-30)
                    if d > worst_loss:
                        worst_loss = d
                    if d > tol:
                        failures.append(f"{name} {schedule}: loss of micro-batch {k} (dp {dp}) {a:.7g} vs 1F1B "
                                        f"{b:.7g}: relative difference {d:.2e} > {tol:g}")
            for c, chunk in enumerate(p["grads"][schedule]):
                for key, g in chunk.items():
                    want = ref.get((tp, dp, key))
                    if want is None:
                        missing.append(key)
                        continue
                    d = _rel(g, want)
                    if d > worst_grad:
                        worst_grad, where = d, f"rank (pp {pp_rank}, tp {tp}, dp {dp}) model[{c}] {key}"
        if missing:
            failures.append(f"{name} {schedule}: {len(missing)} gradients with no 1F1B counterpart, e.g. {missing[0]}")
        if worst_grad > tol:
            failures.append(f"{name} {schedule}: gradient of {where} differs from 1F1B's by {worst_grad:.2e} "
                            f"(relative) > {tol:g}")
        numbers[schedule] = {"max_rel_loss_diff": worst_loss, "max_rel_grad_diff": worst_grad}
        details.append(f"{name} {schedule} vs Megatron 1F1B, M={2 * pp}: max relative loss difference "
                       f"{worst_loss:.2e}, max relative gradient difference {worst_grad:.2e} ({where or 'all bit-identical'})")
    # The two copies of every stage after the SGD steps: bit for bit.
    differing, compared = [], 0
    for (pp_rank, tp, dp), p in by_coord.items():
        partner = by_coord[(pp - 1 - pp_rank, tp, dp)]
        mirror, home = p["copies"][1], partner["copies"][0]
        for key, v in mirror.items():
            compared += 1
            if key not in home or not np.array_equal(v, home[key]):
                differing.append(f"rank (pp {pp_rank}, tp {tp}, dp {dp}) model[1] {key}")
    if differing:
        failures.append(f"{name}: after {STEPS} DualPipe SGD steps {len(differing)} of {compared} parameters of "
                        f"the stage copies differ, e.g. {differing[0]}")
    details.append(f"{name} dualpipe after {STEPS} SGD steps: {compared - len(differing)} of {compared} parameter "
                   f"tensors of the mirrors bit-identical to their partners'")
    numbers["copies_identical"] = not differing
    return details, failures, numbers


def judge(ctx, payloads: List[dict]) -> StageResult:
    tol = ctx.cfg.tolerance
    details = [f"tolerance ({ctx.cfg.dtype_key}): {tol:g} relative to the largest |value| of each loss/tensor"]
    failures, numbers, parts = [], {}, []
    for name in payloads[0]["models"]:
        spec = ctx.cfg.spec(moe=name == "MoE")
        details.append(f"{name}: {spec.label()}")
        d, f, n = _compare_model(ctx, name, payloads, tol)
        details += d
        failures += f
        numbers[name] = n
        parts.append(f"{name}: loss {max(n[s]['max_rel_loss_diff'] for s in (DUALPIPE, DUALPIPEV)):.1e}, "
                     f"grad {max(n[s]['max_rel_grad_diff'] for s in (DUALPIPE, DUALPIPEV)):.1e}"
                     f"{', copies bit-identical' if n['copies_identical'] else ', COPIES DIFFER'}")
    head = f"DualPipe and DualPipeV vs Megatron 1F1B (tolerance {tol:g}): " + "; ".join(parts)
    if failures:
        return StageResult(NAME, FAIL, failures[0] + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""),
                           failures + details, numbers)
    return StageResult(NAME, PASS, head, details, numbers)

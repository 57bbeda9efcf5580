"""Stage ``equality``: the tiny GPT (with ``--ep`` also a tiny MoE) from the same weights under
Megatron's 1F1B, DualPipe and DualPipeV: losses and gradients within the dtype's tolerance of 1F1B's
and of the pp=1 reference, DualPipe's two copies of every stage bit-identical after a few SGD steps,
and with ``--te`` the TE matrix (:mod:`.te_matrix`). What the CPU tests prove, proven through the
same code (:mod:`..proof`) on the user's layers, backend and devices.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch

from . import faults, te_matrix
from .against_1f1b import vs_1f1b
from ..proof import models, names, reference
from ..proof.compare import Gap
from .result import FAIL, PASS, StageResult
from ..schedule import registry
from ..schedule.registry import DUALPIPE, DUALPIPEV, ONE_F_ONE_B

NAME = "equality"
STEPS, LR = 3, 0.1


def _one_model(ctx, spec: models.ModelSpec) -> dict:
    m = 2 * ctx.cfg.pp
    whole = models.full_model(spec)
    full = reference.weights(whole)
    ref_losses, per_mb = reference.per_microbatch(whole, models.batches(spec, m))
    ref_grads = {key: reference.mean_grad(per_mb, key) for key in per_mb[0]}
    del whole, per_mb
    losses, grads, vs_ref = {}, {}, {}
    for schedule in models.SCHEDULES:
        chunks = models.build(spec, schedule, full)
        micro = models.batches(spec, m)
        if schedule != ONE_F_ONE_B:
            micro = faults.faulty(micro)
        losses[schedule] = models.run_iteration(spec, schedule, chunks, micro, p2p_timeout=ctx.cfg.deadline_s)
        grads[schedule] = models.grads_by_full_name(chunks, full)
        vs_ref[schedule] = _against_reference(losses[schedule], grads[schedule], ref_losses, ref_grads)
        if registry.get(schedule).mirrored:
            copies = _train_steps(ctx, spec, chunks, full)
    return {"losses": losses, "grads": grads, "copies": copies, "vs_reference": vs_ref}


def _against_reference(losses, grads, ref_losses, ref_grads) -> dict:
    """This rank's gaps to the pp=1 reference: losses (last rank) and every gradient of every chunk."""
    loss, grad = Gap(), Gap()
    for k, (got, want) in enumerate(zip(losses or [], ref_losses)):  # a count that differs: see 1F1B's check
        loss.add(got, want, f"micro-batch {k}")
    for c, chunk in enumerate(grads):
        for key, g in chunk.items():
            grad.add(g, ref_grads[key], f"model[{c}] {key}")
    return {"loss": loss.rel if loss.pairs else None, "grad": grad.rel, "where": grad.where,
            "line": grad.line("gradients")}


def _train_steps(ctx, spec, chunks, full) -> List[Dict[str, np.ndarray]]:
    """A few SGD steps with DualPipe (from the gradients just computed); each chunk's parameters."""
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=LR)
    for step in range(STEPS):
        if step:
            models.zero_grads(chunks)
            models.run_iteration(spec, DUALPIPE, chunks, models.batches(spec, 2 * ctx.cfg.pp, step),
                                 p2p_timeout=ctx.cfg.deadline_s)
        opt.step()
    return [names.by_full_name(c, full, lambda p: p.detach().cpu().float().numpy()) for c in chunks]


def run(ctx) -> dict:
    out = {"coord": ctx.coord, "models": {"GPT": _one_model(ctx, ctx.cfg.spec())}}
    if ctx.cfg.ep > 1:
        out["models"]["MoE"] = _one_model(ctx, ctx.cfg.spec(moe=True))
    if ctx.cfg.te:
        out["te_matrix"] = te_matrix.run(ctx)
    return out


def _vs_reference(name: str, payloads: List[dict], schedule: str, tol: float, failures: List[str],
                  details: List[str]) -> dict:
    """``schedule`` against the pp=1 reference: the losses, and the worst rank's gradients (all its tensors)."""
    gaps = [p["models"][name]["vs_reference"][schedule] for p in payloads]
    loss = max((g["loss"] for g in gaps if g["loss"] is not None), default=0.0)
    worst = max(range(len(gaps)), key=lambda r: gaps[r]["grad"])
    if loss > tol:
        failures.append(f"{name} {schedule}: losses differ from the pp=1 reference's by {loss:.2e} (relative) "
                        f"> {tol:g}")
    if gaps[worst]["grad"] > tol:
        failures.append(f"{name} {schedule}: gradients of rank {worst} differ from the pp=1 reference's by "
                        f"{gaps[worst]['grad']:.2e} (relative) > {tol:g}, most at {gaps[worst]['where']}")
    details.append(f"{name} {schedule} vs the pp=1 reference: losses {loss:.2e} (relative); "
                   f"rank {worst}'s {gaps[worst]['line']}")
    return {"rel_loss_diff": loss, "rel_grad_diff": gaps[worst]["grad"]}


def _copies(by_coord: dict, pp: int) -> Tuple[int, List[str]]:
    """The mirrors (model[1]) against their partners' model[0] after the SGD steps: (compared, differing)."""
    differing, compared = [], 0
    for (pp_rank, tp, dp), p in by_coord.items():
        home = by_coord[(pp - 1 - pp_rank, tp, dp)]["copies"][0]
        for key, v in p["copies"][1].items():
            compared += 1
            if key not in home or not np.array_equal(v, home[key]):
                differing.append(f"rank (pp {pp_rank}, tp {tp}, dp {dp}) model[1] {key}")
    return compared, differing


def _compare_model(ctx, name: str, payloads: List[dict], tol: float, details: List[str], failures: List[str]) -> dict:
    """One model's numbers, its details and failures added: vs 1F1B (its failures lead), pp=1, the copies."""
    pp, numbers = ctx.cfg.pp, {}
    by_coord = {tuple(p["coord"]): p["models"][name] for p in payloads}
    for schedule in (DUALPIPE, DUALPIPEV):
        numbers[schedule] = vs_1f1b(ctx, name, by_coord, schedule, tol, failures, details)
    numbers["vs_reference"] = {s: _vs_reference(name, payloads, s, tol, failures, details) for s in models.SCHEDULES}
    compared, differing = _copies(by_coord, pp)
    if differing:
        failures.append(f"{name}: after {STEPS} DualPipe SGD steps {len(differing)} of {compared} parameters of "
                        f"the stage copies differ, e.g. {differing[0]}")
    details.append(f"{name} dualpipe after {STEPS} SGD steps: {compared - len(differing)} of {compared} parameter "
                   f"tensors of the mirrors bit-identical to their partners'")
    numbers["copies_identical"] = not differing
    return numbers


def judge(ctx, payloads: List[dict]) -> StageResult:
    tol = ctx.cfg.tolerance
    details = [f"tolerance ({ctx.cfg.dtype_key}): {tol:g} relative to the largest |value| of each loss/tensor "
               f"(against the pp=1 reference: of all a rank's tensors)"]
    failures, numbers, parts = [], {}, []
    for name in payloads[0]["models"]:
        spec = ctx.cfg.spec(moe=name == "MoE")
        details.append(f"{name}: {spec.label()}")
        numbers[name] = n = _compare_model(ctx, name, payloads, tol, details, failures)
        parts.append(f"{name}: loss {max(n[s]['max_rel_loss_diff'] for s in (DUALPIPE, DUALPIPEV)):.1e}, "
                     f"grad {max(n[s]['max_rel_grad_diff'] for s in (DUALPIPE, DUALPIPEV)):.1e}, "
                     f"pp=1 reference {max(v['rel_grad_diff'] for v in n['vs_reference'].values()):.1e}"
                     f"{', copies bit-identical' if n['copies_identical'] else ', COPIES DIFFER'}")
    lines = []
    if ctx.cfg.te:
        lines, numbers["te_matrix"] = te_matrix.judge(ctx, payloads, details, failures)
        parts.append(f"TE matrix: {sum(line.startswith('[PASS]') for line in lines)} of {len(lines)} combinations "
                     f"equal, {sum(line.startswith('[SKIP]') for line in lines)} skipped")
    head = f"DualPipe and DualPipeV vs Megatron 1F1B (tolerance {tol:g}): " + "; ".join(parts)
    if failures:
        return StageResult(NAME, FAIL, failures[0] + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""),
                           failures + details, numbers, lines=lines)
    return StageResult(NAME, PASS, head, details, numbers, lines=lines)

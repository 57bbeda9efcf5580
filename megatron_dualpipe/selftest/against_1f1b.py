"""A selftest model's losses and gradients under one schedule against Megatron's own 1F1B's, on
every rank: what the equality, TE-matrix and DeepSeek-V3 stages all judge by."""
from __future__ import annotations

from typing import List, Optional

from ..proof.compare import Gap, rel_diff
from ..schedule.registry import ONE_F_ONE_B


def vs_1f1b(ctx, name: str, by_coord: dict, schedule: str, tol: float, failures: List[str], details: List[str],
            label: Optional[str] = None) -> dict:
    """``schedule``'s losses and gradients against Megatron 1F1B's, each tensor relative to its own scale:
    its failures and report line (``label``: the schedule's name there) added, its numbers returned.
    ``by_coord``: every rank's ``{"losses": {schedule: ...}, "grads": {schedule: [per chunk]}}``."""
    pp = ctx.cfg.pp
    ref = {(tp, dp, key): g for (_, tp, dp), p in by_coord.items() for key, g in p["grads"][ONE_F_ONE_B][0].items()}
    losses, grads, missing, compared = Gap(), Gap(), [], set()
    for (pp_rank, tp, dp), p in sorted(by_coord.items()):
        if pp_rank == pp - 1:
            want, got = p["losses"][ONE_F_ONE_B], p["losses"][schedule]
            if got is None or len(got) != len(want):
                failures.append(f"{name} {schedule}: the last rank returned {got} losses, 1F1B {len(want)}")
                continue
            for k, (a, b) in enumerate(zip(got, want)):
                if losses.add(a, b, f"micro-batch {k}") > tol:
                    failures.append(f"{name} {schedule}: loss of micro-batch {k} (dp {dp}) {a:.7g} vs 1F1B "
                                    f"{b:.7g}: relative difference {rel_diff(a, b):.2e} > {tol:g}")
        for c, chunk in enumerate(p["grads"][schedule]):
            for key, g in chunk.items():
                if (tp, dp, key) not in ref:
                    missing.append(key)
                    continue
                grads.add(g, ref[(tp, dp, key)], f"rank (pp {pp_rank}, tp {tp}, dp {dp}) model[{c}] {key}")
                compared.add((tp, dp, key))
    if missing:
        failures.append(f"{name} {schedule}: {len(missing)} gradients with no 1F1B counterpart, e.g. {missing[0]}")
    unmatched = sorted(set(ref) - compared)
    if unmatched:
        tp, dp, key = unmatched[0]
        failures.append(f"{name} {schedule}: {len(unmatched)} of 1F1B's gradients never computed, e.g. {key} "
                        f"(tp {tp}, dp {dp})")
    if grads.worst > tol:
        failures.append(f"{name} {schedule}: gradient of {grads.worst_where} differs from 1F1B's by {grads.worst:.2e} "
                        f"(relative) > {tol:g}")
    details.append(f"{name} {label or schedule} vs Megatron 1F1B, M={2 * pp}: max relative loss difference "
                   f"{losses.worst:.2e}, max relative gradient difference {grads.worst:.2e} ("
                   f"{grads.worst_where or 'all bit-identical'}; every one of 1F1B's {len(compared)} gradient "
                   f"tensors compared)")
    return {"max_rel_loss_diff": losses.worst, "max_rel_grad_diff": grads.worst,
            "gradients_of_1f1b_compared": len(compared)}

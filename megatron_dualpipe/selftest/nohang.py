"""Stages ``no hang``, bounded by the deadline: :class:`OddMicrobatches` (odd M and pp <= M < 2pp
finish with 1F1B's losses) and :class:`RankRaises` (one rank raises; its pipeline peers must stop naming
a rank within the deadline; run last, as it leaves the point-to-point traffic in an unknown state).
"""
from __future__ import annotations

import time
from typing import List

from ..proof import models
from ..proof.compare import Gap
from ..proof.nohang import Stop, attempt, peers_stopped, raising_forward_step
from .result import FAIL, PASS, StageResult
from ..schedule.registry import DUALPIPE, DUALPIPEV, ONE_F_ONE_B

#: Seconds a peer may take beyond the deadline to notice and report (a loaded machine).
GRACE_S = 15.0


def _cases(pp: int):
    odd = pp + 1  # odd, and pp <= M < 2pp
    return [(DUALPIPE, odd), (DUALPIPEV, odd), (DUALPIPE, pp)] + ([] if pp + 3 >= 2 * pp else
                                                                        [(DUALPIPE, pp + 3)])


class OddMicrobatches:
    NAME = "no hang (odd M, pp <= M < 2pp)"

    @staticmethod
    def run(ctx) -> dict:
        spec = ctx.cfg.spec()
        full = models.full_state_dict(spec)
        out = {"coord": ctx.coord, "runs": []}
        ref_chunks = models.build(spec, ONE_F_ONE_B, full)
        for schedule, m in _cases(ctx.cfg.pp):
            micro = models.batches(spec, m, step=7)
            ref = models.run_iteration(spec, ONE_F_ONE_B, ref_chunks, micro, p2p_timeout=ctx.cfg.deadline_s)
            chunks = models.build(spec, schedule, full)
            t0 = time.perf_counter()
            losses = models.run_iteration(spec, schedule, chunks, micro, p2p_timeout=ctx.cfg.deadline_s)
            out["runs"].append({"schedule": schedule, "m": m, "seconds": time.perf_counter() - t0,
                                "losses": losses, "ref": ref})
        return out

    @staticmethod
    def judge(ctx, payloads: List[dict]) -> StageResult:
        tol = ctx.cfg.tolerance
        details, failures, parts = [], [], []
        for runs in zip(*(p["runs"] for p in payloads)):
            slowest = max(r["seconds"] for r in runs)
            gap = Gap()
            for r in runs:
                if r["losses"] is not None:
                    for a, b in zip(r["losses"], r["ref"]):
                        gap.add(a, b)
                    if len(r["losses"]) != r["m"]:
                        failures.append(f"{r['schedule']} M={r['m']}: {len(r['losses'])} losses returned")
            name, m = runs[0]["schedule"], runs[0]["m"]
            if gap.worst > tol:
                failures.append(f"{name} M={m}: losses differ from 1F1B's by {gap.worst:.2e} (relative) > {tol:g}")
            details.append(f"{name} M={m} (pp={ctx.cfg.pp}{', odd' if m % 2 else ''}): finished in {slowest:.2f} s "
                           f"(deadline {ctx.cfg.deadline_s:g} s), losses vs 1F1B {gap.worst:.1e}")
            parts.append(f"{name} M={m} {slowest:.1f} s")
        if failures:
            return StageResult(OddMicrobatches.NAME, FAIL, failures[0], failures + details)
        return StageResult(OddMicrobatches.NAME, PASS, "all finished, 1F1B's losses: " + ", ".join(parts), details)


class RankRaises:
    NAME = "no hang (a rank raises)"
    VICTIM = (1, 0, 0)  # (pp, tp, dp) coordinates of the rank that raises

    @staticmethod
    def run(ctx) -> dict:
        spec = ctx.cfg.spec()
        full = models.full_state_dict(spec)
        step = raising_forward_step(models.forward_step, fails=ctx.coord == RankRaises.VICTIM)

        def iteration():  # the build too: a rank still building when the victim fails stops there (abort signal)
            chunks = models.build(spec, DUALPIPE, full)
            models.run_iteration(spec, DUALPIPE, chunks, models.batches(spec, 2 * ctx.cfg.pp),
                                 p2p_timeout=ctx.cfg.deadline_s, forward_step_func=step)

        stop = attempt(iteration)
        return {"coord": ctx.coord, "seconds": stop.seconds, "at": stop.at, "error": stop.error, "rank": ctx.rank}

    @staticmethod
    def judge(ctx, payloads: List[dict]) -> StageResult:
        name = RankRaises.NAME
        victim = [p for p in payloads if tuple(p["coord"]) == RankRaises.VICTIM][0]
        pipeline = [p for p in payloads if tuple(p["coord"])[1:] == RankRaises.VICTIM[1:]]
        stops = {p["rank"]: Stop(p["error"], p["seconds"], p["at"]) for p in payloads}
        details, failures = [], []
        if stops[victim["rank"]].kind != "InjectedFailure":
            failures.append(f"rank {victim['rank']} should have raised the injected failure; got: "
                            f"{stops[victim['rank']].first_line()[:200]}")
        failures += peers_stopped({p["rank"]: stops[p["rank"]] for p in pipeline}, victim["rank"],
                                  ctx.cfg.deadline_s + GRACE_S)
        for p in sorted(pipeline, key=lambda p: p["coord"][0]):
            details.append(f"rank {p['rank']} (pp {p['coord'][0]}): stopped after {p['seconds']:.1f} s: "
                           f"{stops[p['rank']].first_line()[:300]}")
        for p in payloads:  # tensor/data-parallel peers of the pipeline: reported, not judged
            if p not in pipeline:
                details.append(f"rank {p['rank']} (pp, tp, dp) = {tuple(p['coord'])}, another pipeline: stopped "
                               f"after {p['seconds']:.1f} s: {stops[p['rank']].first_line()[:300]}")
        slowest = max(p["seconds"] for p in pipeline)
        if failures:
            return StageResult(name, FAIL, failures[0], failures + details)
        return StageResult(name, PASS, f"rank {victim['rank']} raised; its {len(pipeline) - 1} pipeline peers stopped "
                                       f"with errors naming a rank within {slowest:.1f} s (deadline "
                                       f"{ctx.cfg.deadline_s:g} s + {GRACE_S:g} s)", details)

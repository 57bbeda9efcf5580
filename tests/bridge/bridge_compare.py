"""What the Bridge tests share: why they skip, and how a run's logged metrics are compared with Bridge's
1F1B (split over two test files so that CI's two workers share them)."""
from __future__ import annotations

import importlib.util
import os

from harness.workers import TORCH_PRELOAD, run_workers
from megatron_lm_runs import SLACK


def why_not() -> str:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        return "Megatron-Bridge is not installed here (docs/megatron-bridge.md: its venv)"
    from megatron_dualpipe.bridge import version_gate

    return "; ".join(version_gate.problems())


WHY_NOT = why_not()
HERE = os.path.dirname(os.path.abspath(__file__))


def run_ranks(fn, world: int, args=(), timeout: float = 600):
    """``fn`` on ``world`` ranks forked from a forkserver that imported torch and then ``bridge_preload``
    (the CPU mode's stand-ins, Transformer Engine's among them, which Bridge imports, before megatron-core)
    and nothing else: a server kept from an earlier megatron-core test had imported it without them.
    Python 3.11's forkserver does not take this process's ``sys.path``: it finds this folder on PYTHONPATH
    (an import that fails there is skipped silently, and each rank would import Bridge itself)."""
    path = os.environ.get("PYTHONPATH", "")
    if HERE not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, path) if p)
    return run_workers(fn, world, args=args, timeout=timeout, preimport=(*TORCH_PRELOAD, "bridge_preload"),
                       exact_preload=True)


#: Relative difference allowed between a schedule's metric and Bridge's 1F1B's: the same sums in
#: another order (DualPipeV's ranks group the stages otherwise), carried by Adam. ``num zeros``
#: (exact zeros in the gradients) gets Megatron-LM tests' absolute slack (``megatron_lm_runs.SLACK``).
RELATIVE = 1e-5


def relative(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is b else float("inf")
    return abs(a - b) / max(abs(b), 1e-12)


def gaps(got: dict, ref: dict, what: str) -> dict:
    """{metric: (largest relative difference, largest absolute difference, where)} over every row;
    asserts that both runs logged the same rows and metrics."""
    gaps = {}
    for part in ("train", "eval"):
        assert len(got[part]) == len(ref[part]) > 0, f"{what}: {part} rows {len(got[part])} vs {len(ref[part])}"
        for i, (row, ref_row) in enumerate(zip(got[part], ref[part])):
            assert sorted(row) == sorted(ref_row), f"{what}: {part} row {i} logs {sorted(row)} vs {sorted(ref_row)}"
            for key, value in row.items():
                gap = (relative(value, ref_row[key]), abs((value or 0.0) - (ref_row[key] or 0.0)))
                if key not in gaps or gap > gaps[key][:2]:
                    gaps[key] = (*gap, f"{part} row {i + 1}: {value!r} vs {ref_row[key]!r}")
    return gaps


def table(logged: dict) -> str:
    lines = []
    for schedule, metrics in logged.items():
        for i, row in enumerate(metrics["train"]):
            shown = ", ".join(f"{k} {v:.7g}" for k, v in row.items() if v is not None)
            lines.append(f"{schedule:>11} it {i + 1}: {shown}")
        for i, row in enumerate(metrics["eval"]):
            lines.append(f"{schedule:>11} eval {i + 1}: " + ", ".join(f"{k} {v:.7g}" for k, v in row.items()))
    return "\n".join(lines)


def compare(logged: dict, stages: dict) -> dict:
    """Print and check every metric of dualpipe and dualpipev against Bridge's 1F1B; their largest gaps."""
    print("\n" + table(logged))
    ref = logged["bridge-1f1b"]
    losses = [row["loss/lm loss"] for row in ref["train"]]
    assert losses[-1] < losses[0], f"Bridge's 1F1B did not train: lm loss {losses}"
    held = {schedule: logged[schedule]["stages"] for schedule in logged}
    print(f"stages held by the last pipeline rank: {held}")
    assert held == stages, held
    worst = {}
    for schedule in ("dualpipe", "dualpipev"):
        worst[schedule] = found = gaps(logged[schedule], ref, schedule)
        for key, (relative, absolute, where) in sorted(found.items()):
            print(f"{schedule} vs Bridge's 1F1B: {key}: largest difference {absolute:.3g} (relative {relative:.3g}), "
                  f"{where}")
        for key, (relative, absolute, where) in found.items():
            if key in SLACK:  # counts of exact zeros: rounding residues land on 0.0 or next to it
                assert absolute <= SLACK[key], f"{schedule}: {key} {where}, more than {SLACK[key]} apart"
            else:
                assert relative <= RELATIVE, f"{schedule}: {key} {where}, relative difference {relative:.3g}"
    return worst

"""Megatron-Bridge's own ``pretrain()`` under DualPipe and DualPipeV, against Bridge's own 1F1B.

A tiny GPT recipe (``bridge_recipe.py``: tied embeddings and untied, the TE layer spec through the CPU mode's
stand-ins, the distributed optimizer, overlapped gradient reduction, an evaluation) trains on 4 gloo
processes (pp=4) through Bridge's ``pretrain``: its own, and the package's drop-in with
``schedule="dualpipe"`` / ``"dualpipev"``. Every metric Bridge logs is compared, each iteration.
The tiny MoE recipe (expert parallel 2 x pp=2 x dp=2, alltoall, aux loss and z-loss, one MTP layer) and
tensor parallel 2 with sequence parallelism x pp=2
the same way, its MoE and MTP lines included; a torch_dist checkpoint of iteration 2 saved under
dualpipe or dualpipev is resumed by Bridge's 1F1B and 1F1B's by each, against an uninterrupted 1F1B run.
Skipped where Megatron-Bridge is not installed (docs/megatron-bridge.md says how to make its venv).
"""
from __future__ import annotations

import importlib.util

import pytest

from harness.workers import run_workers
from megatron_lm_runs import SLACK

import bridge_recipe


def _why_not() -> str:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        return "Megatron-Bridge is not installed here (docs/megatron-bridge.md: its venv)"
    from megatron_dualpipe.bridge import version_gate

    return "; ".join(version_gate.problems())


WHY_NOT = _why_not()
#: smoke: CI's oldest tier installs Bridge 0.3.1 (BRIDGE=0.3.1 scripts/setup_venv.sh) and runs these
pytestmark = [pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "-"), pytest.mark.smoke]

#: Relative difference allowed between a schedule's metric and Bridge's 1F1B's: the same sums in
#: another order (DualPipeV's ranks group the stages otherwise), carried by Adam. ``num zeros``
#: (exact zeros in the gradients) gets Megatron-LM tests' absolute slack (``megatron_lm_runs.SLACK``).
RELATIVE = 1e-5


def _relative(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is b else float("inf")
    return abs(a - b) / max(abs(b), 1e-12)


def _gaps(got: dict, ref: dict, what: str) -> dict:
    """{metric: (largest relative difference, largest absolute difference, where)} over every row;
    asserts that both runs logged the same rows and metrics."""
    gaps = {}
    for part in ("train", "eval"):
        assert len(got[part]) == len(ref[part]) > 0, f"{what}: {part} rows {len(got[part])} vs {len(ref[part])}"
        for i, (row, ref_row) in enumerate(zip(got[part], ref[part])):
            assert sorted(row) == sorted(ref_row), f"{what}: {part} row {i} logs {sorted(row)} vs {sorted(ref_row)}"
            for key, value in row.items():
                gap = (_relative(value, ref_row[key]), abs((value or 0.0) - (ref_row[key] or 0.0)))
                if key not in gaps or gap > gaps[key][:2]:
                    gaps[key] = (*gap, f"{part} row {i + 1}: {value!r} vs {ref_row[key]!r}")
    return gaps


def _table(logged: dict) -> str:
    lines = []
    for schedule, metrics in logged.items():
        for i, row in enumerate(metrics["train"]):
            shown = ", ".join(f"{k} {v:.7g}" for k, v in row.items() if v is not None)
            lines.append(f"{schedule:>11} it {i + 1}: {shown}")
        for i, row in enumerate(metrics["eval"]):
            lines.append(f"{schedule:>11} eval {i + 1}: " + ", ".join(f"{k} {v:.7g}" for k, v in row.items()))
    return "\n".join(lines)


def _compare(logged: dict, stages: dict) -> dict:
    """Print and check every metric of dualpipe and dualpipev against Bridge's 1F1B; their largest gaps."""
    print("\n" + _table(logged))
    ref = logged["bridge-1f1b"]
    losses = [row["loss/lm loss"] for row in ref["train"]]
    assert losses[-1] < losses[0], f"Bridge's 1F1B did not train: lm loss {losses}"
    held = {schedule: logged[schedule]["stages"] for schedule in logged}
    print(f"stages held by the last pipeline rank: {held}")
    assert held == stages, held
    worst = {}
    for schedule in ("dualpipe", "dualpipev"):
        worst[schedule] = gaps = _gaps(logged[schedule], ref, schedule)
        for key, (relative, absolute, where) in sorted(gaps.items()):
            print(f"{schedule} vs Bridge's 1F1B: {key}: largest difference {absolute:.3g} (relative {relative:.3g}), "
                  f"{where}")
        for key, (relative, absolute, where) in gaps.items():
            if key in SLACK:  # counts of exact zeros: rounding residues land on 0.0 or next to it
                assert absolute <= SLACK[key], f"{schedule}: {key} {where}, more than {SLACK[key]} apart"
            else:
                assert relative <= RELATIVE, f"{schedule}: {key} {where}, relative difference {relative:.3g}"
    return worst


@pytest.mark.parametrize("tied", [True, False], ids=["tied-embeddings", "untied-embeddings"])
def test_dualpipe_and_dualpipev_log_what_bridges_1f1b_logs(tied):
    logged = run_workers(bridge_recipe.train_each, bridge_recipe.PP,
                         args=(("bridge-1f1b", "dualpipe", "dualpipev"), tied), timeout=600)[-1]
    _compare(logged, {"bridge-1f1b": [None], "dualpipe": [3, 0], "dualpipev": [3, 4]})


def test_moe_with_expert_parallel_and_mtp_logs_what_bridges_1f1b_logs():
    """The tiny MoE (expert parallel 2 x pp=2 x dp=2, alltoall, aux loss and z-loss, one MTP layer):
    Bridge's MoE and MTP lines (load_balancing_loss, z_loss, mtp_1 loss) compared with the rest."""
    logged = run_workers(bridge_recipe.train_each, 4,
                         args=(("bridge-1f1b", "dualpipe", "dualpipev"), True, "moe"), timeout=600)[-1]
    worst = _compare(logged, {"bridge-1f1b": [None], "dualpipe": [1, 0], "dualpipev": [1, 2]})
    for schedule, gaps in worst.items():
        assert {"loss/load_balancing_loss", "loss/z_loss", "loss/mtp_1 loss"} <= set(gaps), (schedule, sorted(gaps))


def test_tensor_parallel_with_sequence_parallelism_logs_what_bridges_1f1b_logs():
    """Tensor parallel 2 with sequence parallelism x pp=2 (TE layers through the CPU mode's stand-in):
    the recipes' TP, every metric against Bridge's 1F1B."""
    logged = run_workers(bridge_recipe.train_each, 4,
                         args=(("bridge-1f1b", "dualpipe", "dualpipev"), True, "tp2"), timeout=600)[-1]
    _compare(logged, {"bridge-1f1b": [None], "dualpipe": [1, 0], "dualpipev": [1, 2]})


def test_a_checkpoint_saved_under_dualpipe_or_dualpipev_resumes_under_bridges_1f1b_and_back(tmp_path):
    """torch_dist through Bridge's save / load: dualpipe's and dualpipev's checkpoints of iteration 2 resumed
    by Bridge's 1F1B for iterations 3-4, and 1F1B's by each, every one equal to an uninterrupted 1F1B run
    (dualpipev's V-stage 0 pads the bucket before the tied embedding's: ``bridge.checkpoint.exact_offsets``)."""
    pairs = (("dualpipe", "bridge-1f1b"), ("bridge-1f1b", "dualpipe"), ("dualpipev", "bridge-1f1b"),
             ("bridge-1f1b", "dualpipev"))
    logged = run_workers(bridge_recipe.save_then_resume, bridge_recipe.PP, args=(str(tmp_path), pairs),
                         timeout=600)[-1]
    print("\n" + _table(logged))
    ref = logged["uninterrupted"]
    for saver, resumer in pairs:
        got = logged[f"{saver}->{resumer}"]
        assert len(got["train"]) == 2, f"{saver}->{resumer}: resumed {len(got['train'])} iterations, not 3-4"
        tail = {"train": ref["train"][2:], "eval": ref["eval"][-len(got["eval"]):], "stages": ref["stages"]}
        for key, (relative, absolute, where) in sorted(_gaps(got, tail, f"{saver}->{resumer}").items()):
            print(f"{saver} saved, {resumer} resumed, vs uninterrupted 1F1B: {key}: largest difference {absolute:.3g} "
                  f"(relative {relative:.3g}), {where}")
            limit = SLACK.get(key)
            assert (absolute <= limit) if limit is not None else (relative <= RELATIVE), f"{saver}->{resumer}: {key}"


def test_a_recipe_dualpipe_cannot_run_is_refused_in_one_line_naming_each_field():
    said, untouched = run_workers(bridge_recipe.refusals, 1, timeout=300)[0]
    for (schedule, mistakes), message in zip(bridge_recipe.MISTAKES, said):
        print(f"{schedule} {sorted(mistakes)}:\n  {message}")
        assert message is not None and "\n" not in message, f"{schedule} {mistakes}: {message!r}"
        for path in mistakes:
            assert path in message, f"{schedule}: the refusal does not name {path}: {message}"
    assert "schedule='zb-h1'" in said[-1]
    assert untouched, "a refused enable() changed Bridge's get_forward_backward_func"


def test_enable_is_idempotent_and_disable_puts_back_every_bridge_name():
    changed, kept, restored, own = run_workers(bridge_recipe.enable_twice_then_disable, 1, timeout=300)[0]
    print(f"replaced by enable: {changed}; kept by a second enable: {kept}; restored by disable: {restored}; "
          f"untouched by enable(schedule='1f1b'): {own}")
    assert len(changed) == 7, "dualpipe replaces 7 Bridge names (bridge.patches: 5 common, 2 for the mirror)"
    assert all(changed) and all(kept) and all(restored) and all(own)

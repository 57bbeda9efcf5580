"""Megatron-Bridge's checkpoints under DualPipe and DualPipeV, its refusals and the switch (the rest of
``test_bridge.py``'s module docstring holds here; split so that CI's two workers share the Bridge tests)."""
from __future__ import annotations

import pytest

import bridge_recipe
from bridge_compare import WHY_NOT, RELATIVE, gaps, run_ranks, table
from harness import megatron_env
from megatron_lm_runs import SLACK

#: smoke: CI's oldest tier installs Bridge 0.3.1 (BRIDGE=0.3.1 scripts/setup_venv.sh) and runs these
pytestmark = [pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "-"), pytest.mark.smoke]


def test_a_checkpoint_saved_under_dualpipe_or_dualpipev_resumes_under_bridges_1f1b_and_back(tmp_path):
    """torch_dist through Bridge's save / load: dualpipe's and dualpipev's checkpoints of iteration 2 resumed
    by Bridge's 1F1B for iterations 3-4, and 1F1B's by each, every one equal to an uninterrupted 1F1B run
    (dualpipev's V-stage 0 pads the bucket before the tied embedding's: ``bridge.checkpoint.exact_offsets``).
    The uninterrupted run is the 1F1B checkpoint's saver, and the saving runs of dualpipe and dualpipev
    equal it too."""
    pairs = (("dualpipe", "bridge-1f1b"), ("bridge-1f1b", "dualpipe"), ("dualpipev", "bridge-1f1b"),
             ("bridge-1f1b", "dualpipev"))
    logged = run_ranks(bridge_recipe.save_then_resume, bridge_recipe.PP, args=(str(tmp_path), pairs),
                       timeout=600)[-1]
    print("\n" + table(logged))
    ref = logged["uninterrupted"]
    for saver in ("dualpipe", "dualpipev"):
        for key, (relative, absolute, where) in sorted(gaps(logged[saver], ref, f"{saver} saving").items()):
            print(f"{saver} saving vs uninterrupted 1F1B: {key}: largest difference {absolute:.3g} "
                  f"(relative {relative:.3g}), {where}")
            limit = SLACK.get(key)
            assert (absolute <= limit) if limit is not None else (relative <= RELATIVE), f"{saver} saving: {key}"
    for saver, resumer in pairs:
        got = logged[f"{saver}->{resumer}"]
        assert len(got["train"]) == 2, f"{saver}->{resumer}: resumed {len(got['train'])} iterations, not 3-4"
        tail = {"train": ref["train"][2:], "eval": ref["eval"][-len(got["eval"]):], "stages": ref["stages"]}
        for key, (relative, absolute, where) in sorted(gaps(got, tail, f"{saver}->{resumer}").items()):
            print(f"{saver} saved, {resumer} resumed, vs uninterrupted 1F1B: {key}: largest difference {absolute:.3g} "
                  f"(relative {relative:.3g}), {where}")
            limit = SLACK.get(key)
            assert (absolute <= limit) if limit is not None else (relative <= RELATIVE), f"{saver}->{resumer}: {key}"


def test_a_recipe_dualpipe_cannot_run_is_refused_in_one_line_naming_each_field():
    said, untouched = run_ranks(bridge_recipe.refusals, 1, timeout=300)[0]
    for (schedule, mistakes), message in zip(bridge_recipe.MISTAKES, said):
        print(f"{schedule} {sorted(mistakes)}:\n  {message}")
        assert message is not None and "\n" not in message, f"{schedule} {mistakes}: {message!r}"
        for path in mistakes:
            assert path in message, f"{schedule}: the refusal does not name {path}: {message}"
    assert "schedule='zb-h1'" in said[-1]
    assert untouched, "a refused enable() changed Bridge's get_forward_backward_func"


def test_enable_is_idempotent_and_disable_puts_back_every_bridge_name():
    changed, kept, restored, own = run_ranks(bridge_recipe.enable_twice_then_disable, 1, timeout=300)[0]
    print(f"replaced by enable: {changed}; kept by a second enable: {kept}; restored by disable: {restored}; "
          f"untouched by enable(schedule='1f1b'): {own}")
    assert len(changed) == 7, "dualpipe replaces 7 Bridge names (bridge.patches: 5 common, 2 for the mirror)"
    assert all(changed) and all(kept) and all(restored) and all(own)


def test_switching_the_cpu_mode_on_after_megatron_core_was_imported_is_refused_in_one_line():
    """A rank forked from a forkserver that preloaded megatron-core (an earlier test's): without the
    refusal, Bridge's import died on ``No module named 'transformer_engine'`` (CI, stop 42)."""
    said = megatron_env.run_workers(bridge_recipe.enable_after_megatron_core, 1, timeout=300, exact_preload=True)[0]
    print(said)
    assert said is not None and "\n" not in said and "before anything imports megatron" in said, said

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


def test_a_checkpoint_chain_through_dualpipe_dualpipev_and_bridges_1f1b_equals_an_uninterrupted_run(tmp_path):
    """torch_dist through Bridge's save / load (``bridge_recipe.CHAIN``): Bridge's 1F1B's checkpoint of
    iteration 2 resumed by dualpipe, dualpipe's of 4 by dualpipev, dualpipev's of 6 by Bridge's 1F1B, each
    leg 2 iterations; every leg's metrics equal to the uninterrupted 1F1B run's (dualpipev's V-stage 0 pads
    the bucket before the tied embedding's: ``bridge.checkpoint.exact_offsets``). Each leg's checkpoint is
    the one pretrain() writes after training: Bridge 0.3 saves it through a name of its own, which the
    adapter missed (dualpipev's then held the embedding's optimizer state 64 elements off; 1F1B resumed
    it with lm loss 5.348886 instead of 5.349062)."""
    logged = run_ranks(bridge_recipe.save_then_resume, bridge_recipe.PP, args=(str(tmp_path),), timeout=600)[-1]
    print("\n" + table(logged))
    ref = logged["uninterrupted"]
    assert len(ref["train"]) == bridge_recipe.CHAIN_ITERS, f"uninterrupted: {len(ref['train'])} iterations"
    # Evaluations: one every 2 iterations, then the end's (validation and test sets). A leg's first is the
    # uninterrupted run's at the leg's last iteration; its end's match only where the run ends too.
    evals, interval = ref["eval"], bridge_recipe.CHAIN_ITERS // 2
    for leg, (saver, resumer) in enumerate(zip(("bridge-1f1b", *bridge_recipe.CHAIN), bridge_recipe.CHAIN), 1):
        got, last = logged[f"{saver}->{resumer}"], 2 * leg + 2
        assert len(got["train"]) == 2, f"{saver}->{resumer}: resumed {len(got['train'])} iterations, not 2"
        assert len(got["eval"]) == 1 + len(evals) - interval, f"{saver}->{resumer}: {len(got['eval'])} evaluations"
        ends = evals[interval:] if last == bridge_recipe.CHAIN_ITERS else []
        got = {**got, "eval": got["eval"][:1 + len(ends)]}
        tail = {"train": ref["train"][last - 2:last], "eval": [evals[leg], *ends], "stages": ref["stages"]}
        for key, (relative, absolute, where) in sorted(gaps(got, tail, f"{saver}->{resumer}").items()):
            print(f"{saver} saved at {last - 2}, {resumer} resumed to {last}, vs uninterrupted 1F1B: {key}: "
                  f"largest difference {absolute:.3g} (relative {relative:.3g}), {where}")
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
    changed, kept, restored, own, stale = run_ranks(bridge_recipe.enable_twice_then_disable, 1, timeout=300)[0]
    print(f"replaced by enable: {changed}; kept by a second enable: {kept}; restored by disable: {restored}; "
          f"untouched by enable(schedule='1f1b'): {own}; replaced functions still bound elsewhere: {stale}")
    from megatron_dualpipe.bridge.version_gate import installed_bridge_version

    # bridge.patches: 0.3 calls by name from train, pretrain and setup (6 common), 0.6 through its checkpoint
    # manager (5); 2 for the mirror
    expected = 8 if installed_bridge_version().startswith("0.3") else 7
    assert len(changed) == expected, f"dualpipe replaces {expected} names of Bridge {installed_bridge_version()}"
    assert all(changed) and all(kept) and all(restored) and all(own)
    assert not stale, f"Bridge calls these by a name enable() did not replace: {stale}"


def test_switching_the_cpu_mode_on_after_megatron_core_was_imported_is_refused_in_one_line():
    """A rank forked from a forkserver that preloaded megatron-core (an earlier test's): without the
    refusal, Bridge's import died on ``No module named 'transformer_engine'`` (CI, stop 42)."""
    said = megatron_env.run_workers(bridge_recipe.enable_after_megatron_core, 1, timeout=300, exact_preload=True)[0]
    print(said)
    assert said is not None and "\n" not in said and "before anything imports megatron" in said, said

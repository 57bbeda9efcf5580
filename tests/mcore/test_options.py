"""The one table of Megatron options (megatron_dualpipe/mcore/options.py): the same rule read from
Megatron-LM's ``args`` and from a ``TransformerConfig``. Standard library only (milliseconds)."""
from types import SimpleNamespace

import pytest

from megatron_dualpipe.mcore import options
from megatron_dualpipe.schedule import registry


def _config(**kw):
    """A TransformerConfig stand-in (the attributes the rules read) with Megatron's defaults."""
    base = dict(mtp_num_layers=None, cuda_graph_impl="none", qk_clip=False, moe_router_load_balancing_type="aux_loss",
                overlap_p2p_comm=False, variable_seq_lengths=False, init_model_with_meta_device=False,
                num_microbatches_with_partial_activation_checkpoints=None, overlap_moe_expert_parallel_comm=False,
                expert_model_parallel_size=1, num_moe_experts=None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(autouse=True)
def no_virtual_pipeline(monkeypatch):
    """The one rule that asks megatron-core's parallel_state (not imported here): no virtual pipeline."""
    monkeypatch.setattr(options, "_virtual_pipeline", lambda source, side: False)


@pytest.mark.parametrize("schedule", registry.names(runs_on=registry.EXECUTOR))
def test_defaults_are_accepted_on_both_sides(schedule):
    assert options.problems(_config(), schedule, options.CONFIG) == []
    assert options.problems(SimpleNamespace(), schedule, options.ARGS) == []


def test_one_rule_read_from_args_and_from_a_config():
    args, config = SimpleNamespace(qk_clip=True), _config(qk_clip=True)
    from_args = options.problems(args, registry.DUALPIPE, options.ARGS)
    from_config = options.problems(config, registry.DUALPIPE, options.CONFIG)
    print(f"\nargs: {from_args}\nconfig: {from_config}")
    assert from_args == from_config and len(from_args) == 1 and "--qk-clip" in from_args[0]
    assert options.problems(args, registry.DUALPIPEV, options.ARGS) == []  # no mirror: accepted


def test_megatron_lm_turns_overlap_p2p_off_itself_so_only_the_config_is_checked():
    """Megatron-LM's --overlap-p2p-communication defaults to on and validate_args turns it off
    without a virtual pipeline (refused): an args check could never fire; the config's can."""
    rule = next(r for r in options.REFUSED if r.flag == "--overlap-p2p-communication")
    assert not rule.applies(options.ARGS) and rule.applies(options.CONFIG)
    msgs = options.problems(_config(overlap_p2p_comm=True), registry.EXECUTOR_1F1B, options.CONFIG)
    assert len(msgs) == 1 and "turn off --overlap-p2p-communication" in msgs[0]


def test_combined_step_requirements_only_while_it_is_on():
    off = SimpleNamespace(expert_model_parallel_size=1, num_experts=None, moe_token_dispatcher_type="allgather")
    assert options.problems(off, registry.DUALPIPE, options.ARGS) == []
    on = SimpleNamespace(overlap_moe_expert_parallel_comm=True, **vars(off))
    msgs = options.problems(on, registry.DUALPIPE, options.ARGS)
    print("\n" + "\n".join(msgs))
    assert len(msgs) == 3 and all(m.startswith(options.COMBINED_STEP + ": ") for m in msgs)
    assert options.combined_step_problems(off, options.ARGS) == [m.split(": ", 1)[1] for m in msgs]
    one_chunk = options.problems(on, registry.EXECUTOR_1F1B, options.ARGS)
    assert len(one_chunk) == 1 and f"does not support {options.COMBINED_STEP}" in one_chunk[0]


def test_every_refusal_names_what_to_change():
    for rule in options.REFUSED:
        assert rule.applies(options.ARGS) or rule.applies(options.CONFIG), rule.flag
        assert set(rule.schedules) <= set(registry.names(runs_on=registry.EXECUTOR)), rule.flag
        msg = rule.message()
        assert any(word in msg for word in ("remove", "turn off", "set ", "use ")), msg
        assert rule.flag.split()[0].split("/")[0].strip() in msg or rule.needs, msg

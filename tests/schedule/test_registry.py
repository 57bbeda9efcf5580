"""The schedule registry is the one place for each schedule fact.

* Each entry's rules agree with what its generator builds (chunks per rank, layout, the smallest
  micro-batch count, padding, the data split), checked by building the schedules.
* No other module of the package restates a schedule: the names appear as string constants only
  in ``schedule/registry.py`` (other code uses ``registry.DUALPIPE`` etc. or asks a spec).
"""
import ast
import pathlib

import pytest

from megatron_dualpipe.schedule import registry
from megatron_dualpipe.schedule.actions import F
from megatron_dualpipe.schedule.registry import ScheduleError, build_schedule

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_dualpipe"


def test_names_appear_only_in_the_registry():
    names = set(registry.NAMES) | set(registry.MODELLED_SPECS)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "schedule" / "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}")
    print(f"\nscanned {len(list(PACKAGE.rglob('*.py')))} modules for {sorted(names)}; restated: {len(found)}")
    assert not found, "schedule names restated outside the registry:\n" + "\n".join(found)


@pytest.mark.parametrize("name", registry.NAMES)
@pytest.mark.parametrize("pp", [2, 4, 6, 8])
def test_rules_agree_with_the_generator(name, pp):
    spec = registry.get(name)
    if spec.pp_problem(pp):
        with pytest.raises(ScheduleError):
            build_schedule(name, pp, 4 * pp)
        return
    least = spec.min_microbatches(pp)
    s = build_schedule(name, pp, least)
    # Chunks per rank: the distinct stages each rank runs.
    for r, acts in enumerate(s.ranks):
        assert len({(a.dir, a.stage) for a in acts}) == spec.chunks_per_rank, (name, pp, r)
    # Model stages: the stages a micro-batch passes through, over all directions' routes.
    stages = {a.stage for acts in s.ranks for a in acts if a.dir == 0} | \
             {a.stage for acts in s.ranks for a in acts if a.dir == 1}
    assert len(stages) == spec.model_stages(pp)
    if least > 1:
        with pytest.raises(ScheduleError):
            build_schedule(name, pp, least - 1)
    assert spec.defers_weight_grads == any(a.op == "W" for acts in s.ranks for a in acts)


@pytest.mark.parametrize("name", registry.NAMES)
@pytest.mark.parametrize("pp", [2, 4])
def test_padding_builds_and_holds_every_real_microbatch(name, pp):
    spec = registry.get(name)
    for real in range(spec.min_real_microbatches(pp), 4 * pp + 2):
        padded = spec.padded_microbatches(pp, real)
        s = build_schedule(name, pp, padded)  # the padded count is always buildable
        per_dir = s.microbatches_per_direction()
        split = spec.split(real)
        assert sum(split) == real
        # Every real micro-batch of every data direction is run; the rest are fake.
        for d, n in enumerate(split):
            assert n <= per_dir[d]
            assert all(not spec.is_fake(real, d, mb) for mb in range(n))
            assert all(spec.is_fake(real, d, mb) for mb in range(n, per_dir[d]))
        seen = sorted(spec.global_index(real, d, mb) for d, n in enumerate(split) for mb in range(n))
        assert seen == list(range(real))
        # The order runs ``padded`` micro-batches, entered from data in the data directions.
        entered = {(a.dir, a.mb) for acts in s.ranks for a in acts
                   if a.op == F and s.layout.is_first(a.dir, a.stage)}
        assert len(entered) == padded


def test_only_megatron_runs_1f1b_natively():
    assert registry.names(runs_on=registry.MEGATRON) == (registry.DEFAULT,)
    assert set(registry.names(runs_on=registry.EXECUTOR)) == set(registry.NAMES) - {registry.DEFAULT}


def test_distinct_orders_drop_the_executor_copy_of_1f1b():
    assert registry.EXECUTOR_1F1B not in registry.distinct_orders()
    a, b = build_schedule(registry.ONE_F_ONE_B, 4, 8), build_schedule(registry.EXECUTOR_1F1B, 4, 8)
    assert a.ranks == b.ranks


def test_unknown_name_lists_every_name():
    with pytest.raises(ScheduleError) as e:
        registry.get("dual-pipe")
    for n in registry.NAMES:
        assert n in str(e.value)

"""``advise``: the choice follows the closed forms where they are exact and the memory limit, never
a schedule its own model says is slower (within 1% the reason names the lighter one); the reason
names the numbers; the table and the JSON carry every schedule, Megatron's interleaved 1F1B
included."""
import json

import pytest

from megatron_dualpipe.cli.advise import parse_counts
from megatron_dualpipe.costs.advice import TIE, advise
from megatron_dualpipe.cli import main
from megatron_dualpipe.cli import CliError
from megatron_dualpipe.schedule.registry import (DUALPIPE, DUALPIPEV, INTERLEAVED_1F1B, INTERLEAVED_1F1B_A2A,
                                                 ONE_F_ONE_B, ZB_H1)
from megatron_dualpipe.schedule.simulate import Costs

# DeepSeek's setting f = w = b/2, fb = f + b: every bubble equals its closed form, so makespans are
# busy (M x (f + b) per rank) + bubble, computed here without the simulator.
COSTS = Costs(f=1, b=2, w=1)


def expected_makespan(name, pp, m):
    f, b, w, fb = COSTS.f, COSTS.b, COSTS.w, COSTS.fused
    bubble = {ONE_F_ONE_B: (pp - 1) * (f + b), ZB_H1: (pp - 1) * (f + b - 2 * w),
              DUALPIPE: (pp / 2 - 1) * (fb + b - 3 * w), DUALPIPEV: (pp - 1) * (fb + b - 3 * w) / 2,
              INTERLEAVED_1F1B: (pp - 1) * (f + b) / 2}[name]
    return m * (f + b) + bubble


@pytest.mark.parametrize("m", [16, 32])
def test_choice_follows_the_closed_forms_and_is_never_slower(m):
    pp = 8
    names = [ONE_F_ONE_B, ZB_H1, DUALPIPE, DUALPIPEV, INTERLEAVED_1F1B]
    a = advise(pp, [m], COSTS, activation_memory=1.0, parameter_memory=10.0, names=names)
    ch = a.choices[0]
    got = {o.row.name: o.row.makespan for o in ch.options}
    want = {n: expected_makespan(n, pp, m) for n in got}
    print(f"\nM={m}: {got}\n  {ch.reason}")
    assert got == pytest.approx(want)
    fastest = min(want, key=want.get)
    assert ch.best == fastest == DUALPIPE
    near = [n for n in want if n != fastest and want[n] <= want[fastest] * (1 + TIE)]
    if not near:  # M=16: dualpipe 54 against 55: 1.8% faster
        assert "1.8% shorter than the best other schedule that fits, zb-h1 (55)" in ch.reason
        assert "21.7% shorter than Megatron's plain 1F1B (69)" in ch.reason and "(+11 against zb-h1)" in ch.reason
    else:  # M=32: dualpipe 102 against zb-h1 103, within 1%: still the faster, the lighter one named
        assert set(near) == {ZB_H1, DUALPIPEV} and f"{ZB_H1} is within 1.0% (103) and needs 11 less memory" in ch.reason


def test_memory_limit_excludes_the_mirror():
    a = advise(8, [16], COSTS, activation_memory=1.0, parameter_memory=10.0, memory_limit=20)
    ch = a.choices[0]
    fits = {o.row.name: o.fits for o in ch.options}
    print(f"\n{ch.reason}")
    # interleaved 1F1B (v=2) keeps 11.5 stages' activations at pp=8, 12 with the EP overlap's extra forward
    assert fits == {ONE_F_ONE_B: True, ZB_H1: True, DUALPIPE: False, DUALPIPEV: True, INTERLEAVED_1F1B: False,
                    INTERLEAVED_1F1B_A2A: False}
    assert ch.best == ZB_H1 and "dualpipe would be 1.8% faster but needs 29, over the limit 20" in ch.reason


def test_nothing_fits():
    ch = advise(4, [8], COSTS, activation_memory=5, parameter_memory=10, memory_limit=1).choices[0]
    assert ch.best is None and "no schedule fits the memory limit 1" in ch.reason


def test_1f1b_when_nothing_is_faster():
    """With w = 0 nothing can be deferred and DualPipe's mirror buys nothing at large M: Megatron's own wins."""
    ch = advise(4, [64], Costs(f=1, b=2, w=0), 1.0, 10.0, names=[ONE_F_ONE_B, ZB_H1]).choices[0]
    assert ch.best == ONE_F_ONE_B and "Megatron's own" in ch.reason


def test_odd_pp_lists_dualpipe_as_unable():
    ch = advise(3, [6], COSTS, 1.0, 1.0).choices[0]
    rows = {o.row.name: o.row for o in ch.options}
    assert rows[DUALPIPE].problem and "even" in rows[DUALPIPE].problem and ch.best != DUALPIPE


def test_counts():
    assert parse_counts("16") == [16]
    assert parse_counts("8,12,8") == [8, 12]
    assert parse_counts("8:64") == [8, 16, 32, 64]
    assert parse_counts("8:40") == [8, 16, 32, 40]
    assert parse_counts("8:24:8") == [8, 16, 24]
    for bad in ("8:4", "0", "a", "8:64:0", "1:2:3:4"):
        with pytest.raises(CliError):
            parse_counts(bad)


def test_cli_table_and_json(capsys):
    argv = ["advise", "--pp", "8", "-m", "16:32", "--f", "1", "--b", "2", "--w", "1", "--activation-memory", "1",
            "--parameter-memory", "10", "--memory-limit", "25"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    assert "M=16: use zb-h1" in out and "M=32: use zb-h1" in out and "<- best" in out
    assert out.count("dualpipev") >= 2 and "(DualPipeV runs chunks of half a stage at half these costs)" in out
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["microbatches"] for c in doc["choices"]] == [16, 32] and doc["memory_limit"] == 25
    opts = {o["schedule"]: o for o in doc["choices"][0]["options"]}
    assert opts[DUALPIPE]["fits"] is False and opts[DUALPIPE]["parameter_memory"] == 20
    assert opts[DUALPIPEV]["peak_activations"] == 8.5


def test_advise_says_what_the_pair_placement_does_and_refuses_what_cannot_be_placed(capsys):
    """The seed's 1.3B case (pp=8, dp=4, 8 GPUs per node): advise prints dualpipe's iteration with
    the launcher's --pair-placement, the same figure as advising with --placement paired; with
    tp=8 on 8-GPU nodes the pairing is impossible, said in the line and refused as a --placement."""
    common = ["advise", "--pp", "8", "-m", "20", "--f", "1.664", "--b", "3.328", "--w", "1.664",
              "--activation-memory", "1", "--parameter-memory", "1", "--stage-params", "162.5e6",
              "--message-bytes", "8.4e6", "--schedules", "1f1b,dualpipe", "--json"]
    assert main(common + ["--dp", "4"]) == 0
    plain = json.loads(capsys.readouterr().out)["choices"][0]
    assert main(common + ["--dp", "4", "--placement", "paired"]) == 0
    paired = json.loads(capsys.readouterr().out)["choices"][0]
    iteration = {c: {o["schedule"]: o["iteration"] for o in ch["options"]}
                 for c, ch in (("plain", plain), ("paired", paired))}
    effect, back = plain["placement"][0], paired["placement"][0]
    assert effect["schedule"] == DUALPIPE and effect["placement"] == "paired" and effect["problem"] is None
    assert effect["iteration"] == pytest.approx(iteration["paired"][DUALPIPE])
    assert back["iteration"] == pytest.approx(iteration["plain"][DUALPIPE]) and back["placement"] == "megatron"
    assert iteration["paired"][ONE_F_ONE_B] == iteration["plain"][ONE_F_ONE_B]  # 1f1b is never paired
    assert effect["fastest"] == (iteration["paired"][DUALPIPE] < iteration["plain"][ONE_F_ONE_B])
    assert main(common + ["--dp", "2", "--tp", "8"]) == 0
    refused = json.loads(capsys.readouterr().out)["choices"][0]["placement"][0]
    assert refused["iteration"] is None and "split the tensor-parallel groups of 8" in refused["problem"]
    assert main(common + ["--dp", "2", "--tp", "8", "--placement", "paired"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--placement paired: " in err and "tensor-parallel groups of 8" in err
    with capsys.disabled():
        print(f"\n{iteration}\n{effect}\n{back}\n{refused}")


def test_advise_says_what_each_way_of_summing_the_copies_does_with_the_flag(capsys):
    """The seed's 1.3B case with the distributed optimizer: for dualpipe, advise prints the iteration
    under the other two ways training combines the copies (dp-first: --dualpipe-dp-first; the shared
    shard group, reduced after the schedule as training does), each the figure advising with that
    --bd-reduction gives; dp-first there puts dualpipe ahead of 1f1b, which advise says. Without the
    distributed optimizer nothing is said (neither flag runs)."""
    common = ["advise", "--pp", "8", "-m", "20", "--f", "1.664", "--b", "3.328", "--w", "1.664",
              "--activation-memory", "1", "--parameter-memory", "1", "--stage-params", "162.5e6",
              "--message-bytes", "8.4e6", "--schedules", "1f1b,dualpipe", "--dp", "4", "--json"]

    def choice(*extra):
        assert main(common + list(extra)) == 0
        return json.loads(capsys.readouterr().out)["choices"][0]

    def iteration(ch, name):
        return next(o["iteration"] for o in ch["options"] if o["schedule"] == name)

    now = choice("--distributed-optimizer")
    effects = {e["bd_reduction"]: e for e in now["bd_reduction"]}
    assert sorted(effects) == ["dp-first", "shared-shard"]
    dp_first = iteration(choice("--distributed-optimizer", "--bd-reduction", "dp-first"), DUALPIPE)
    shared = iteration(choice("--distributed-optimizer", "--bd-reduction", "shared-shard", "--no-overlap-grad-reduce"),
                       DUALPIPE)
    with capsys.disabled():
        print(f"\nbd-first {iteration(now, DUALPIPE):.3f}, dp-first {dp_first:.3f}, shared {shared:.3f}, 1f1b "
              f"{iteration(now, ONE_F_ONE_B):.3f}; {effects}")
    assert effects["dp-first"]["iteration"] == pytest.approx(dp_first)
    assert effects["dp-first"]["flag"] == "--dualpipe-dp-first"
    assert effects["shared-shard"]["iteration"] == pytest.approx(shared)
    assert effects["shared-shard"]["flag"] == "--dualpipe-shared-shard-group"
    assert effects["dp-first"]["fastest"] == (dp_first < iteration(now, ONE_F_ONE_B)) is True
    assert choice()["bd_reduction"] == []


def test_simulate_takes_the_placement(capsys):
    """``simulate --placement paired``: dualpipe's bd sums move inside the node (the seed's 1.3B case);
    1f1b, which the launcher never pairs, keeps Megatron's placement and its figures."""
    got, other = {}, {}
    for name in (DUALPIPE, ONE_F_ONE_B):
        for placement in ("megatron", "paired"):
            assert main(["simulate", "--schedule", name, "--pp", "8", "-m", "20", "--f", "1.664", "--b", "3.328",
                         "--w", "1.664", "--stage-params", "162.5e6", "--message-bytes", "8.4e6", "--dp", "4",
                         "--placement", placement, "--json"]) == 0
            doc = json.loads(capsys.readouterr().out)
            g = doc["gradient_communication"]
            got[(name, placement)] = (g["iteration"], max(g["bd_sum_per_rank"]))
            if name == DUALPIPE:  # it also says what the other placement gives
                other[placement] = doc["other_placement"]
            else:
                assert doc["other_placement"] is None
    with capsys.disabled():
        print(f"\n(iteration, largest bd sum per rank) in ms: {got}")
    assert got[(DUALPIPE, "paired")][0] < got[(DUALPIPE, "megatron")][0]
    assert got[(DUALPIPE, "paired")][1] < got[(DUALPIPE, "megatron")][1] / 4  # NVLink 200 GB/s against 25 GB/s
    assert got[(ONE_F_ONE_B, "paired")] == got[(ONE_F_ONE_B, "megatron")]
    assert other["megatron"]["placement"] == "paired" and other["paired"]["placement"] == "megatron"
    assert other["megatron"]["iteration"] == pytest.approx(got[(DUALPIPE, "paired")][0])
    assert other["paired"]["iteration"] == pytest.approx(got[(DUALPIPE, "megatron")][0])


def test_a_small_gain_bought_with_memory_is_called_so():
    """At M=256 DualPipe's bubble saving is a few percent of the iteration while its parameters
    double: the reason says so, with both figures; at M=16 (21.7% shorter) it does not."""
    ch = advise(8, [256], COSTS, 1.0, 10.0, names=[ONE_F_ONE_B, DUALPIPE]).choices[0]
    opts = {o.row.name: o for o in ch.options}
    gain = 100 * (opts[ONE_F_ONE_B].row.makespan - opts[DUALPIPE].row.makespan) / opts[ONE_F_ONE_B].row.makespan
    more = 100 * (opts[DUALPIPE].memory - opts[ONE_F_ONE_B].memory) / opts[ONE_F_ONE_B].memory
    print(f"\n{ch.reason}\n  gain {gain:.2f}%, memory +{more:.1f}%")
    assert ch.best == DUALPIPE and gain < 5
    assert f"a small gain: {gain:.1f}% shorter for {more:.0f}% more memory than 1f1b" in ch.reason
    assert "a small gain" not in advise(8, [16], COSTS, 1.0, 10.0, names=[ONE_F_ONE_B, DUALPIPE]).choices[0].reason


def test_the_recommended_schedule_is_named_with_the_flags_that_run_it(capsys):
    """Interleaved 1F1B is Megatron's 1f1b with a virtual pipeline: its flag is named (with the
    layer count unknown, as the formula); an executor schedule by the launch script's SCHEDULE."""
    from megatron_dualpipe.costs.advice import run_flags

    assert run_flags(INTERLEAVED_1F1B, 8) == ("SCHEDULE=1f1b with --num-layers-per-virtual-pipeline-stage "
                                              "(--num-layers / 16: 2 chunks per rank) appended, i.e. Megatron's own "
                                              "--pipeline-schedule 1f1b with a virtual pipeline of 2")
    assert "--num-layers-per-virtual-pipeline-stage 2 appended" in run_flags(INTERLEAVED_1F1B, 8, num_layers=32)
    assert "--num-layers-per-virtual-pipeline-stage 1 appended" in run_flags("interleaved-1f1b-v4", 8, num_layers=32)
    assert run_flags(ZB_H1, 8).startswith("SCHEDULE=zb-h1 (scripts/pretrain_gpt_dualpipe.sh)")
    argv = ["advise", "--pp", "8", "-m", "16", "--f", "1", "--b", "2", "--w", "0", "--activation-memory", "1",
            "--parameter-memory", "1", "--schedules", "1f1b,interleaved-1f1b"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    print("\n" + out)
    assert "M=16: use interleaved-1f1b" in out and "  run it: SCHEDULE=1f1b with --num-layers-per-virtual" in out


def test_effect_lines_say_what_the_user_did_and_whether_it_fits(capsys):
    """The placement line never asks to drop a --pair-placement that was not given, an effect on a
    schedule that does not fit says so (not 'not the fastest that fits'), and a longer iteration is
    called longer."""
    common = ["advise", "--pp", "8", "-m", "20", "--f", "1.664", "--b", "3.328", "--w", "1.664",
              "--activation-memory", "1", "--parameter-memory", "1", "--stage-params", "162.5e6",
              "--message-bytes", "8.4e6", "--schedules", "1f1b,dualpipe", "--distributed-optimizer"]
    assert main(common + ["--dp", "2", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    placement = next(line for line in out.splitlines() if line.startswith("  placement: "))
    assert "cannot have pipeline ranks i and pp-1-i on one node here" in placement and "--pair-placement" not in placement
    assert main(common + ["--dp", "4", "--memory-limit", "10"]) == 0  # dualpipe needs 11
    out = capsys.readouterr().out
    effects = [line for line in out.splitlines() if line.startswith(("  placement: ", "  bd reduction: "))]
    assert effects and all(line.endswith("but it does not fit the memory limit") for line in effects)
    assert main(common + ["--dp", "4", "--placement", "paired"]) == 0
    back = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  placement: "))
    print("\n" + "\n".join([placement] + effects + [back]))
    assert "in Megatron's own rank placement (advise --placement megatron)" in back and "longer" in back

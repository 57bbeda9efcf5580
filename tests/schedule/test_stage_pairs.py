"""Uneven stages without Megatron: layouts read as Megatron reads them, the layouts a schedule can
run, which stages each rank holds and their summed cost (checked against loads written out here
from the schedules' placement: DualPipe's rank i runs stage i and pp-1-i, each for half the
micro-batches; DualPipeV's runs V-stages i and 2pp-1-i)."""
import pytest

from megatron_dualpipe.costs import model_cost as mc
from megatron_dualpipe.schedule import stage_layout as sl
from megatron_dualpipe.costs import stage_pairs as sp
from megatron_dualpipe.costs.model_args import ModelArgsError, parse

#: DeepSeek-V3's 61 layers over pp = 16: 3 + 14 x 4 + 2 (its config), and as 32 V-stages.
V3_STAGES = "Et*3|(t*4|)*14,ttL"
V3_V_STAGES = "Et|(tt|)*29,t|tL"


@pytest.mark.parametrize("text,stages", [
    ("Et|(tt|)*3,tL", ["Et", "tt", "tt", "tt", "tL"]),
    ("E|t*3|(t|)*2,L", ["E", "ttt", "t", "t", "L"]),
    (V3_STAGES, ["Ettt"] + ["tttt"] * 14 + ["ttL"]),
    ("E|ttt|ttt|L", ["E", "ttt", "ttt", "L"]),  # layer-less V-stages: rank 0 holds the embedding and the head
    ("t||t|", ["t", "", "t", ""]),
])
def test_layouts_read_and_written_in_megatrons_syntax(text, stages):
    assert sl.parse(text) == stages
    assert sl.parse(sl.to_text(stages)) == stages
    print(f"\n{text} -> {stages} -> {sl.to_text(stages)}")


def test_halved_and_paired_are_inverse_and_keep_every_layer():
    """pp stages cut into 2pp V-stages (embedding with the first half, loss with the second), and back."""
    stages = sl.parse(V3_STAGES)
    v = sl.halved(stages)
    print(f"\n{V3_STAGES} halved: {sl.to_text(v)}")
    assert len(v) == 32 and sl.paired(v) == stages and sum(sl.decoder_counts(v)) == 61
    assert v[0].startswith("E") and v[-1].endswith("L") and "".join(v) == "".join(stages)
    assert sl.halved(["Et", "tL"]) == ["E", "t", "t", "L"]  # a one-layer end stage leaves no empty V-stage


def test_a_layout_of_another_count_gets_one_of_the_right_count():
    dualpipev = sl.fix("Ett|tt|tt|ttL", 8, 4, "dualpipev")
    dualpipe = sl.fix("Et|(t|)*6,tL", 4, 4, "dualpipe")
    other = sl.fix("Ett|ttt|tttL", 8, 4, "dualpipev")
    print(f"\n{dualpipev}\n{dualpipe}\n{other}")
    for message, want in ((dualpipev, 8), (dualpipe, 4), (other, 8)):
        suggested = sl.parse(message.split("'")[1])
        assert len(suggested) == want and sum(sl.decoder_counts(suggested)) == 8
        assert suggested[0].startswith("E") and suggested[-1].endswith("L")
    assert "has 4 stages" in dualpipev and "has 3 stages" in other
    with pytest.raises(sl.LayoutError, match="unknown letters 'x'"):
        sl.parse("Etx|tL")


def _independent_loads(costs, pp):
    """Per rank: 1F1B c[i]; DualPipe (c[i] + c[pp-1-i]) / 2; DualPipeV from V-stage costs v[i] + v[2pp-1-i]."""
    v = [c / 2 for c in costs for _ in (0, 1)]
    return ([costs[i] for i in range(pp)], [(costs[i] + costs[pp - 1 - i]) / 2 for i in range(pp)],
            [v[i] + v[2 * pp - 1 - i] for i in range(pp)])


def test_pairing_evens_out_a_heavy_last_stage():
    """pp = 4, the last stage twice the others (an output layer): 1F1B's rank 3 carries it alone;
    DualPipe's ranks 0 and 3 carry half of it each with half of stage 0; every load printed and
    equal to the loads written out independently."""
    costs = [1.0, 1.0, 1.0, 2.0]
    stages, v = sp.views(costs, 4)
    one, dual, vee = _independent_loads(costs, 4)
    assert sp.loads("1f1b", stages) == one and sp.loads("dualpipe", stages) == dual and sp.loads("dualpipev", v) == vee
    text = "\n".join(sp.report(stages, v, ("1f1b", "dualpipe", "dualpipev")))
    print("\n" + text)
    assert "0+3: 1+2=3 (/2 1.5)" in text and "0+7: 0.5+1=1.5" in text
    mean = sum(costs) / 4
    assert f"1f1b x{max(one) / mean:.3f} (rank 3)" in text and f"dualpipe x{max(dual) / mean:.3f}" in text
    assert max(dual) < max(one) and "stage 3 is heavy" in text and "pairs it with stage 0" in text


def test_a_layout_priced_per_layer():
    """DeepSeek-V3's 61 layers in 32 V-stages, the output layer costing 3 layers: 1F1B's stage t is
    V-stages 2t + 2t+1; DualPipeV's rank 0 holds the embedding's and the output layer's V-stages."""
    stages, v = sp.layout_costs(V3_V_STAGES, {"L": 3.0}, 16)
    print(f"\nstages {stages}\nV-stages {v}")
    assert stages == [3.0] + [4.0] * 14 + [5.0] and v[0] == 1.0 and v[31] == 4.0 and sum(v) == 64.0
    assert sp.loads("dualpipev", v)[0] == 5.0
    with pytest.raises(ValueError, match="give 16"):
        sp.layout_costs("Et|tL", {}, 16)


def test_advise_reads_a_layout_of_v_stages():
    """A model's --pipeline-model-parallel-layout: 1F1B's stages pair its V-stages; DualPipeV's are its own."""
    argv = ["--num-layers", "61", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "1024",
            "--vocab-size", "32000", "--pipeline-model-parallel-size", "16"]
    m = parse(argv + ["--pipeline-model-parallel-layout", V3_V_STAGES])
    print(f"\nstages {mc.stage_sizes(m)}, V-stages {mc.v_stage_sizes(m)}")
    assert mc.stage_sizes(m) == (3,) + (4,) * 14 + (2,) and mc.v_stage_sizes(m) == (1,) + (2,) * 29 + (1, 1)
    with pytest.raises(ModelArgsError, match="give 16 .or DualPipeV's 32. stages"):
        parse(argv + ["--pipeline-model-parallel-layout", "Et|tL"])
    with pytest.raises(ModelArgsError, match="drop --decoder-first/last"):
        parse(argv + ["--pipeline-model-parallel-layout", V3_V_STAGES, "--decoder-first-pipeline-num-layers", "3"])

"""``simulate`` and ``advise`` with uneven stages: per-stage costs (or a layout priced per layer; for
advise the model's layout) -> the stages each rank holds under 1F1B, DualPipe and DualPipeV and
their summed cost, and what the pairing does to a heavy end stage. Loads are checked against
ones written out here from the placement (DualPipe's rank i: stages i and pp-1-i for half the
micro-batches each; DualPipeV's: V-stages i and 2pp-1-i)."""
import json
import re

import pytest

from megatron_dualpipe.cli import main

SIM = ["simulate", "--schedule", "dualpipe", "--pp", "4", "--microbatches", "8"]
#: DeepSeek-V3's 61 layers over pp = 16 as 32 V-stages, and a model of that depth for advise.
V3_V_STAGES = "Et|(tt|)*29,t|tL"
MODEL_61 = ["--num-layers", "61", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096",
            "--vocab-size", "129280", "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", "16",
            "--global-batch-size", "256", "--use-distributed-optimizer"]
ROW = re.compile(r"^\s+(\d+)\s+(\d+): (\S+)\s+(\d+)\+(\d+): .*?=(\S+) \(/2 (\S+)\)\s+(\d+)\+(\d+): .*?=(\S+)\s*$")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out):
    """rank -> ((1f1b stage, cost), (dualpipe pair, sum, load), (dualpipev pair, sum)) from the table."""
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            g = m.groups()
            rows[int(g[0])] = ((int(g[1]), float(g[2])), ((int(g[3]), int(g[4])), float(g[5]), float(g[6])),
                               ((int(g[7]), int(g[8])), float(g[9])))
    return rows


def test_simulate_with_stage_costs_shows_each_ranks_pair(capsys):
    """pp = 4, a heavy last stage: every rank's pair and summed cost as placed, and the slowest load."""
    costs = [1.0, 1.0, 1.0, 2.5]
    code, out, err = run(capsys, *SIM, "--stage-costs", ",".join(map(str, costs)))
    print(out[out.index("stages each rank"):])
    assert code == 0, err
    rows = _rows(out)
    v = [c / 2 for c in costs for _ in (0, 1)]
    assert sorted(rows) == [0, 1, 2, 3]
    for r, (one, dual, vee) in rows.items():
        assert one == (r, costs[r])
        assert dual == ((r, 3 - r), costs[r] + costs[3 - r], pytest.approx((costs[r] + costs[3 - r]) / 2))
        assert vee == ((r, 7 - r), pytest.approx(v[r] + v[7 - r]))
    mean = sum(costs) / 4
    assert f"1f1b x{2.5 / mean:.3f} (rank 3)" in out and f"dualpipe x{1.75 / mean:.3f}" in out
    assert "stage 3 is heavy" in out and "DualPipe pairs it with stage 0, the other end" in out


def test_simulate_with_a_layout_and_layer_costs(capsys):
    """A layout of 2pp V-stages priced per letter: 1F1B's stages are its pairs, DualPipeV's ranks hold
    V-stages i and 2pp-1-i (JSON carries both views)."""
    code, out, err = run(capsys, *SIM, "--layout", "Et|ttt|t|t|tt|t|t|tL", "--layer-costs", "E=0.5,L=2", "--json")
    assert code == 0, err
    doc = json.loads(out)
    print(doc["stage_costs"])
    assert doc["stage_costs"] == {"v_stages": [1.5, 3.0, 1.0, 1.0, 2.0, 1.0, 1.0, 3.0],
                                  "stages": [4.5, 2.0, 3.0, 4.0]}


@pytest.mark.parametrize("extra,needle", [
    (["--stage-costs", "1,2,3"], "give 4 (one per stage) or 8"),
    (["--layout", "Et|tL"], "give 4 (1F1B, DualPipe) or 8"),
    (["--layout", "Et|t|t|tL", "--stage-costs", "1,1,1,1"], "give one"),
    (["--layer-costs", "t=2"], "give --layout too"),
    (["--layout", "Et|t|t|tL", "--layer-costs", "x=2"], "LETTER=COST"),
    (["--stage-costs", "1,-1,1,1"], ">= 0"),
])
def test_bad_stage_costs_give_one_line(capsys, extra, needle):
    code, out, err = run(capsys, *SIM, *extra)
    assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, err


def test_advise_a_61_layer_model_in_v_stages(capsys):
    """advise from a model whose layout is DualPipeV's 32 V-stages of 61 layers: each schedule's
    pairs with their forward times, 1F1B's stage t the V-stages 2t and 2t+1."""
    code, out, err = run(capsys, "advise", "--gpu", "H100", "--nodes", "2", "--",
                         *MODEL_61, "--pipeline-model-parallel-layout", V3_V_STAGES)
    print(out[:out.index("not compared") if "not compared" in out else len(out)])
    assert code == 0, err
    rows = _rows(out)
    assert sorted(rows) == list(range(16))
    v = {}
    for r, (_, _, (pair, total)) in rows.items():
        assert pair == (r, 31 - r)
        v[r] = total
    stage = {r: one[1] for r, (one, _, _) in rows.items()}
    for r, (_, (pair, total, load), _) in rows.items():
        assert pair == (r, 15 - r) and total == pytest.approx(stage[r] + stage[15 - r], rel=1e-3)
        assert load == pytest.approx(total / 2, rel=1e-3)
    assert stage[15] > stage[1] > stage[0], stage  # the output layer on the last stage; the first has 3 layers
    assert "dualpipev" in out.split("schedule ")[-1], "dualpipev not compared"


def test_advise_names_the_v_stage_layout_dualpipev_would_run(capsys):
    """A model split by --decoder-first/last-pipeline-num-layers (DeepSeek-V3's 3 + 14 x 4 + 2):
    dualpipev refuses those flags, so advise says the V-stage layout it compares (each stage cut in two)."""
    code, out, err = run(capsys, "advise", "--gpu", "H100", "--nodes", "2", "--", *MODEL_61,
                         "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "2")
    line = next(x for x in out.splitlines() if "dualpipev runs these V-stages" in x)
    print("\n" + line)
    assert code == 0, err
    assert f"--pipeline-model-parallel-layout '{V3_V_STAGES}'" in line

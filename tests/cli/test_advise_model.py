"""``advise`` from the model's shape: a config or pretrain_gpt.py's arguments, a GPU kind and the
node layout give the stage costs and memory (the cost model's figures, printed), the advice names
the exact flags of the schedule it recommends, and every mistake is one line naming the fix."""
import json

import pytest

from megatron_dualpipe.cli import main
from megatron_dualpipe.costs import model_cost as mc
from megatron_dualpipe.costs.model_args import parse
from megatron_dualpipe.cli.advise_model import config_argv

#: gpt_8b with a batch small enough for a fast test (M = 64 on 2 x 8 GPUs).
GPT_8B = ["advise", "--config", "gpt_8b", "--gpu", "H100", "--nodes", "2", "--", "--vocab-size", "128256",
          "--global-batch-size", "64"]


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_gpt_8b_on_two_h100_nodes_prints_the_models_figures_and_the_flags(capsys):
    code, out, err = run(capsys, GPT_8B)
    with capsys.disabled():
        print("\n" + out)
    assert code == 0, err
    m = parse(config_argv("gpt_8b") + ["--vocab-size", "128256", "--global-batch-size", "64"])
    stage = mc.heaviest_stage(m, mc.GPUS["H100"], mc.DEFAULT_MFU, 8)
    mem = mc.heaviest_memory(m, 16)
    assert f"FLOPs: {mc.iteration_flops(m, 64):.4g} per iteration" in out
    assert f"f {stage.f:.3g} ms, b {stage.b:.3g} ms, w {stage.w:.3g} ms" in out
    assert f"optimizer {mem.optimizer / 1e9:.3g}" in out and "limit 80 per rank" in out
    best = next(line for line in out.splitlines() if line.startswith("M=64: use "))
    name = best.split()[2].rstrip(":")
    run_line = next(line for line in out.splitlines() if line.startswith("  run it: "))
    assert (f"SCHEDULE={name} " in run_line if not name.startswith("interleaved") else
            "--num-layers-per-virtual-pipeline-stage 2" in run_line)


def test_interleaved_advice_names_the_virtual_stage_flag_with_the_layer_count(capsys):
    code, out, err = run(capsys, GPT_8B[:3] + ["--schedules", "interleaved-1f1b"] + GPT_8B[3:])
    assert code == 0, err
    doc_line = next(line for line in out.splitlines() if line.startswith("  run it: "))
    print(f"\n{doc_line}")
    # 32 layers, pp=8, 2 chunks per rank: 2 layers per virtual stage
    assert "SCHEDULE=1f1b with --num-layers-per-virtual-pipeline-stage 2 appended" in doc_line


def test_json_carries_the_model_and_the_run_flags(capsys):
    code, out, err = run(capsys, GPT_8B[:3] + ["--json"] + GPT_8B[3:])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["pp"] == 8 and doc["choices"][0]["microbatches"] == 64 and doc["choices"][0]["run"]
    assert doc["model"][0].startswith("model: 32 dense layers")


def test_moe_all_to_all_is_in_the_stage_costs(capsys):
    """Mixtral with EP=8 inside a node: the stage's f carries the all-to-all, and a fused F&B unit
    (DualPipe's overlap) is shorter than f + b."""
    code, out, err = run(capsys, ["advise", "--config", "moe_mixtral_8x7b", "--gpu", "H100", "--nodes", "8", "--",
                                  "--vocab-size", "32000", "--global-batch-size", "64"])
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("stage "))
    print(f"\n{line}")
    assert "of which MoE all-to-all" in line and "fused F&B" in line


BAD = [
    (["advise", "--config", "gpt_8b", "--nodes", "2"], "needs --gpu"),
    (["advise", "--config", "nope", "--gpu", "H100"], "--config nope: no such config"),
    (["advise", "--gpu", "H100", "--", "--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
      "--seq-length", "8"], "give --vocab-size N"),
    (["advise", "--config", "gpt_8b", "--gpu", "H100", "--nodes", "2", "--mfu", "1.5", "--", "--vocab-size", "8"],
     "--mfu must be in (0, 1]"),
    (["advise", "--config", "gpt_8b", "--gpu", "H100", "--nodes", "1", "--gpus-per-node", "12", "--", "--vocab-size",
      "8"], "i.e. of 16: change --nodes/--gpus-per-node"),
    (["advise", "--config", "gpt_8b", "--gpu", "H100", "--nodes", "2", "--", "--vocab-size", "8",
      "--global-batch-size", "3", "--micro-batch-size", "2"], "use a multiple of 2"),
    (["advise", "--config", "gpt_8b", "--gpu", "H100", "--nodes", "2", "--", "--vocab-size", "8", "--num-layers",
      "30"], "--num-layers 30 is not a multiple of --pipeline-model-parallel-size 8"),
    (["advise", "--config", "gpt_8b", "--gpu", "H100", "--pp", "8", "--", "--vocab-size", "8"], "drop --pp"),
    (["advise", "--gpu", "H100", "--", "--num-layers", "4"], "the model needs --hidden-size"),
    (["advise", "--gpu", "H100", "--", "--num-layers", "x"], "--num-layers x: must be a positive integer"),
    (["advise", "--config", "moe_mixtral_8x7b", "--gpu", "H100", "--nodes", "8", "--", "--vocab-size", "8",
      "--moe-layer-freq", "([1]*3)"], "--moe-layer-freq ([1]*3) has 3 entries"),
    (["advise", "--gpu", "V100"], "invalid choice: 'V100'"),
    (["advise", "--config", "gpt_8b", "--gpu", "H100", "--distributed-optimizer", "--", "--vocab-size", "8"],
     "drop --distributed-optimizer"),
    (["advise", "--config", "gpt_8b", "--gpu", "H100", "--nodes", "2", "--intra-bw", "-1", "--", "--vocab-size", "8"],
     "--intra-bw/--inter-bw/--intra-latency/--inter-latency: a link's bandwidth must be"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[b[1][:40] for b in BAD])
def test_every_mistake_is_one_line_naming_the_fix(capsys, argv, needle):
    code, out, err = run(capsys, argv)
    print(f"\n{' '.join(argv)}\n  -> {code}: {err.strip()}")
    assert code == 2 and out == "" and err.count("\n") == 1 and needle in err and "Traceback" not in err


V3_LIKE = ("--num-layers 64 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --multi-latent-attention "
           "--q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 "
           "--seq-length 4096 --vocab-size 129280 --num-experts 256 --moe-ffn-hidden-size 2048 "
           "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-layer-freq ([0]*3+[1]*61) "
           "--mtp-num-layers 1 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --bf16 "
           "--use-distributed-optimizer --overlap-grad-reduce --recompute-granularity full "
           "--pipeline-model-parallel-size 16 --expert-model-parallel-size 32 --micro-batch-size 1 "
           "--global-batch-size 512").split()


def test_the_shared_shard_group_is_judged_on_one_optimizer_state(capsys):
    """DeepSeek-V3-like on 64 x 8 H100: DualPipe's two copies exceed 80 GB, but with
    --dualpipe-shared-shard-group the rank keeps one stage's optimizer state, not two; whether that
    fits follows from the cost model's memory (parameters and gradients twice, optimizer once)."""
    code, out, err = run(capsys, ["advise", "--gpu", "H100", "--nodes", "64", "--schedules", "1f1b,dualpipe", "--"]
                         + V3_LIKE)
    assert code == 0, err
    m = parse(V3_LIKE)
    mem = mc.heaviest_memory(m, 512)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  dualpipe ")}
    act = float(rows["dualpipe"][8])  # the table's activation memory of dualpipe
    shared = 2 * (mem.parameters + mem.gradients) / 1e9 + mem.optimizer / 1e9 + act
    line = next(x for x in out.splitlines() if "with --dualpipe-shared-shard-group (" in x)
    print(f"\n{line}\n  memory with one optimizer state: {shared:.4g} GB")
    assert rows["dualpipe"][-1] == "no" and (("does not fit" in line) == (shared > 80))

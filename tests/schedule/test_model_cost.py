"""The cost model's stage times: a stage's FLOPs at the GPU's rate, the weight GEMMs' share as W,
the MoE all-to-all at NVLink or network bandwidth. (Its FLOPs and memory against Megatron-LM's own
figures: tests/megatron_lm/test_model_cost_vs_megatron.py.)"""
import pytest

from megatron_dualpipe.costs import model_cost as mc
from megatron_dualpipe.costs.model_args import parse

GPT_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
          "--num-query-groups 8 --seq-length 8192 --vocab-size 128256 --swiglu --normalization RMSNorm "
          "--untie-embeddings-and-output-weights --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 "
          "--sequence-parallel --global-batch-size 512").split()
MIXTRAL = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
           "--num-query-groups 8 --seq-length 4096 --vocab-size 32000 --swiglu --num-experts 8 --moe-router-topk 2 "
           "--pipeline-model-parallel-size 8 --expert-model-parallel-size 8 --global-batch-size 256").split()


def test_a_dense_stage_costs_follow_its_flops():
    """The heaviest stage's times: f is its FLOPs at the rate, w the weight GEMMs' part, b twice f;
    the last stage (output layer) is the slowest of a dense model."""
    m = parse(GPT_8B)
    gpu = mc.GPUS["H100"]
    c = mc.heaviest_stage(m, gpu, 0.5, 8)
    linear, core = mc.stage_flops(m, m.pp - 1)
    rate = gpu.peak_tflops * 1e12 * 0.5 / 1e3
    print(f"\nstage {c.stage}: f {c.f:.4g} b {c.b:.4g} w {c.w:.4g} ms; weight GEMMs {linear:.4g}, core {core:.4g} FLOPs")
    assert c.stage == m.pp - 1 and c.fb is None and c.all_to_all == 0
    assert c.f == pytest.approx((linear + core) / rate) and c.w == pytest.approx(linear / rate)
    assert c.b == pytest.approx(2 * c.f)


def test_moe_all_to_all_crosses_nodes_when_ep_does():
    """EP=8 inside an 8-GPU node goes over NVLink; the same EP over 4-GPU nodes over the network."""
    m = parse(MIXTRAL)
    gpu = mc.GPUS["H100"]
    inside, across = mc.all_to_all_ms(m, gpu, 8), mc.all_to_all_ms(m, gpu, 4)
    volume = 2 * m.seq_length * m.topk * m.hidden * 2 * 7 / 8
    print(f"\nall-to-all per MoE layer: {inside:.4g} ms on NVLink, {across:.4g} ms across nodes")
    assert inside == pytest.approx(volume / (gpu.nvlink_gbps * 1e9) * 1e3)
    assert across == pytest.approx(volume / (gpu.network_gbps * 1e9) * 1e3)


def test_uneven_stages_as_megatron_splits_them():
    """--decoder-first/last-pipeline-num-layers: those stages get their counts, the others the rest
    evenly (DeepSeek-V3's 61 layers over pp=16: 3 + 14 x 4 + 2); the first stage's FLOPs are its 3
    layers', and a split that leaves the middle uneven is a problem naming the flags."""
    m = parse([*GPT_8B, "--num-layers", "61", "--pipeline-model-parallel-size", "16",
               "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "2"])
    sizes = mc.stage_sizes(m)
    print(f"\nstage sizes: {sizes}")
    assert sizes == (3,) + (4,) * 14 + (2,) and sum(sizes) == 61 and mc.stages_problem(m) is None
    first, second = mc.stage_flops(m, 0), mc.stage_flops(m, 1)
    assert first[0] == pytest.approx(second[0] * 3 / 4) and first[1] == pytest.approx(second[1] * 3 / 4)
    bad = parse([*GPT_8B, "--num-layers", "61", "--pipeline-model-parallel-size", "16",
                 "--decoder-first-pipeline-num-layers", "2"])
    problem = mc.stages_problem(bad)
    print(f"refused: {problem}")
    assert problem and "--decoder-first-pipeline-num-layers" in problem
    assert mc.stages_problem(parse([*GPT_8B, "--num-layers", "30"])) is not None

"""Transformer Engine layers (``--transformer-impl transformer_engine``, Megatron-LM's default and every
GPU user's) through ``pretrain_gpt.py`` on CPU, on the CPU mode's stand-ins for Transformer Engine,
grouped_gemm, DeepEP and apex's wgrad GEMM (``megatron_dualpipe/cpu/stand_ins``): DualPipe and
DualPipeV (DualPipeV resuming Megatron's own 1F1B checkpoint) equal to Megatron's own 1F1B with the
same stand-ins, every metric ``training_log`` prints.

Zero bubble through TE: the executor's schedules run with ``--delay-wgrad-compute``, so every TE
module queues its weight gradient in B and the W action pops it (``mcore.wgrad.TEQueues``; each
iteration ends checking that no queue is left). Megatron's 1F1B cannot take that flag without its
combined step (megatron-core's own rule), so its TE modules compute their weight gradients inline:
the same numbers by another order. Linear biases are off: TE's ``backward_dw`` loses a bias gradient
when two backwards of one module are pending (B, B, W, W), refused before training.

Every ``--recompute-modules`` value of megatron-core 0.16.1 runs under the B/W split: core_attn, mlp (on
the dense layers of ``--moe-layer-freq 2``: an MoE layer ignores it), layernorm, moe_act and moe (the
whole MoE layer, its all-to-all again in B) in the grouped-GEMM case; shared_experts and mla_up_proj in
the fused F&B units. Refused before training: moe with the fused units (they never run the checkpointed
layer), gdn_norm_out of 0.19 with the ``--experimental-attention-variant`` it needs.
"""
import pytest

from megatron_lm_runs import (HAVE_MEGATRON_LM, LAST_OUTPUT, MOE_EP2, SKIP_MESSAGE, assert_metrics_close,
                              run_pretrain)
from test_megatron_lm_dualpipev import PP2, _as_resumed_at, _set_latest

pytestmark = pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE)

TE = ("--transformer-impl", "transformer_engine", "--disable-bias-linear")
ZERO_BUBBLE_THROUGH_TE = ("--delay-wgrad-compute",)
#: Untied: Megatron's own 1f1b cannot save tied embeddings with MTP in torch_dist (test_megatron_lm_mtp.py).
MTP = ("--mtp-num-layers", "1", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights")
#: Multi-latent attention (low-rank q and kv, decoupled RoPE heads; rope type YaRN, MLA's default).
MLA = ("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16")
FUSION = "--no-gradient-accumulation-fusion"  # left out of the tiny GPT's flags: fusion on
PARTLY = "zero bubble partly inactive"

#: case -> (flags of every run, flags of the executor's runs only, the tiny GPT's flags left out)
CASES = {
    # fp32: with MTP in bf16 the local and TE layers alike differ from 1f1b by ~1e-5 in lm loss from the third
    # iteration on, as bf16 with the fusion does (fp32 weight gradients summed in another order); bf16 below
    # with gradient-accumulation fusion, --defer-embedding-wgrad-compute, FP8 tensorwise, --first-last-layers-bf16
    # (MTP with the deferred output weight gradients is refused; TE with MTP and zero bubble: the last case)
    "dense, fusion, deferred output wgrads, FP8": (
        (*TE, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
         "--num-layers-at-start-in-bf16", "1", "--num-layers-at-end-in-bf16", "1", "--defer-embedding-wgrad-compute",
         "--wgrad-deferral-limit", "2"), ZERO_BUBBLE_THROUGH_TE, (FUSION,)),
    "MoE EP2, grouped GEMM, overlapped shared experts, selective recomputation": (
        (*TE, *MOE_EP2, "--moe-layer-freq", "2", "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size", "64",
         "--moe-shared-expert-overlap", "--recompute-granularity", "selective", "--recompute-modules", "core_attn",
         "mlp", "layernorm", "moe_act", "moe"), ZERO_BUBBLE_THROUGH_TE, ()),
    "MoE EP2, grouped GEMM, flex dispatcher (DeepEP), fused F&B units, bf16": (
        (*TE, *MOE_EP2, "--moe-grouped-gemm", "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep", "--bf16"),
        ("--overlap-moe-expert-parallel-comm", *ZERO_BUBBLE_THROUGH_TE), ()),
    "MoE EP2, shared experts, MLA, fused F&B units, MTP, selective recomputation": (
        (*TE, *MOE_EP2, *MTP, *MLA, "--moe-shared-expert-intermediate-size", "64", "--recompute-granularity",
         "selective", "--recompute-modules", "shared_experts", "mla_up_proj"),
        ("--overlap-moe-expert-parallel-comm", *ZERO_BUBBLE_THROUGH_TE), ()),
    # the local layers' zero bubble (the plugin's own deferral) into main_grad through apex's wgrad GEMM
    "local layers, gradient-accumulation fusion": (("--disable-bias-linear",), (), (FUSION,)),
}


#: Cases run with PP2's 2 micro-batches (pp <= M < 2*pp: DualPipe pads each direction to 2, one real): the
#: output layer's one deferred weight gradient per chunk, which Megatron's drain cannot take alone
#: (``mcore.grad_reduction._finish_deferred_output_wgrads``; an UnboundLocalError before).
PADDED = ("dense, fusion, deferred output wgrads, FP8",)


def _no_te_queue_left(schedule):
    assert PARTLY not in LAST_OUTPUT[0], f"{schedule}: TE layers computed weight gradients in B:\n" + \
        "\n".join(line for line in LAST_OUTPUT[0].splitlines() if PARTLY in line)


@pytest.mark.parametrize("case", sorted(CASES))
def test_te_layers_dualpipe_and_dualpipev_equal_megatron_1f1b(case, tmp_path):
    """On PP2's 4 layers (pp=2, dp 2, 4 iterations; 4 micro-batches, or PADDED's 2): Megatron's 1f1b
    saves at iteration 2 and is the reference for iterations 1-4; dualpipe runs the same 4 iterations;
    dualpipev resumes 1f1b's checkpoint of iteration 2. One 1f1b run serves both: the pp=4 pipeline is
    the local spec's and the smoke case's below; what differs here is the layers."""
    flags, own, without = CASES[case]
    sizes = (*PP2, *(() if case in PADDED else ("--global-batch-size", "16")))
    ckpt, v_ckpt = str(tmp_path / "1f1b"), str(tmp_path / "dualpipev")
    resumed = ("--ckpt-format", "torch_dist")
    ref = run_pretrain("1f1b", *flags, *sizes, *resumed, "--save", ckpt, "--save-interval", "2", with_metrics=True,
                       without=without)
    got = run_pretrain("dualpipe", *flags, *sizes, *own, with_metrics=True, without=without)
    _no_te_queue_left("dualpipe")
    worst = assert_metrics_close(got, ref, f"TE {case}: dualpipe vs 1f1b")
    assert "lm loss" in worst and ("mtp_1 loss" in worst) == ("--mtp-num-layers" in flags)
    _set_latest(ckpt, 2)
    got_v = run_pretrain("dualpipev", *flags, *sizes, *own, *resumed, "--load", ckpt,
                         "--save", v_ckpt, "--save-interval", "5", with_metrics=True, without=without)
    _no_te_queue_left("dualpipev")
    assert_metrics_close(got_v, _as_resumed_at(ref, 2), f"TE {case}: dualpipev from 1f1b's checkpoint vs 1f1b")


def test_te_dense_without_fusion_defers_every_weight_gradient_to_w():
    """TE dense layers, no gradient-accumulation fusion: dualpipe equals 1f1b with zero bubble through
    TE's deferral, and without --delay-wgrad-compute the executor's audit names the TE weights B kept
    (the deferral is what moved them to W)."""
    ref = run_pretrain("1f1b", *TE, with_metrics=True)
    got = run_pretrain("dualpipe", *TE, *ZERO_BUBBLE_THROUGH_TE, with_metrics=True)
    _no_te_queue_left("dualpipe")
    assert_metrics_close(got, ref, "TE dense without fusion: dualpipe (zero bubble through TE) vs 1f1b")
    inline = run_pretrain("dualpipe", *TE, with_metrics=True)
    kept = [line for line in LAST_OUTPUT[0].splitlines() if PARTLY in line]
    print(f"without --delay-wgrad-compute: {kept[0][:300] if kept else 'no audit line'}")
    assert kept and "linear_qkv.weight" in kept[0], "the audit did not name the TE weights computed in B"
    assert_metrics_close(inline, ref, "TE dense without fusion: dualpipe (TE weight gradients in B) vs 1f1b")

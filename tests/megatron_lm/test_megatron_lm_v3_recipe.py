"""DeepSeek-V3's recipe through Megatron-LM's ``pretrain_gpt.py`` under ``dualpipe`` and ``dualpipev``,
each equal to Megatron's own 1F1B in every metric ``training_log`` prints (issue 25, items 1 and 4).

One V3-shaped model carries every option of the recipe at once, at tiny sizes on 4 ranks (pp = 2 x
expert parallel 2): multi-latent attention with YaRN RoPE, SwiGLU, RMSNorm, untied embeddings, a
dense first layer, 4 routed experts (top-2 in 2 groups of which 1 is picked, scaled by 2.5) plus a
shared expert, sigmoid scores with expert bias and DeepSeek's sequence-wise auxiliary loss. One
1f1b run is the reference of both schedules: dualpipe starts from the same weights and is compared
at every iteration; dualpipev, whose ranks hold other stages (each initialised from its own seed),
resumes 1f1b's checkpoint of iteration 2 and is compared at 3 and 4 (as in
test_megatron_lm_dualpipev.py). Every copy of every router's ``expert_bias`` is compared too.
The comparison fails when one option differs on the compared side (checked once by hand:
dualpipe with ``--moe-router-group-topk 2``, lm loss 2.3e-2 off at iteration 1; dualpipev with
``--mscale-all-dim 0.9``, 8.4e-4 off at iteration 3).

The smoke case (both tags) runs YaRN and ``--rotary-scaling-factor`` in the CPU mode: multi-latent
attention, whose RoPE is YaRN by default, under dualpipe and 1f1b (``--rotary-base`` and
``--rotary-percent`` are test_megatron_lm_dualpipe.py's smoke case); core_v0.19.0's YaRN for
standard attention (``--position-embedding-type yarn``) is the case after it.
"""
import os

import pytest
import torch

from megatron_lm_runs import (HAVE_MEGATRON_LM, LAST_OUTPUT, MEGATRON_LM_PATH, MOE_EP2, PRINT_EXPERT_BIAS, SKIP_MESSAGE,
                              assert_metrics_close, run_pretrain)
from test_megatron_lm_dualpipev import _as_resumed_at, _set_latest
from test_megatron_lm_options import expert_biases

pytestmark = [
    pytest.mark.skipif(not HAVE_MEGATRON_LM, reason=SKIP_MESSAGE),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests; CPU mode is never active next to a GPU"),
]

#: Multi-latent attention (q and kv low-rank, decoupled RoPE heads) with YaRN: MLA's default rope
#: type, named here with the scaling DeepSeek-V3 used (factor 40, mscale 1 on all dimensions).
MLA_YARN = ("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
            "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--position-embedding-type", "rope",
            "--rope-type", "yarn", "--rotary-base", "10000", "--rotary-scaling-factor", "40", "--mscale", "1.0",
            "--mscale-all-dim", "1.0")
#: Initialised at std 0.1, not 0.02: at 0.02 the tiny model's attention scores are so close to
#: uniform that a 10% change of YaRN's --mscale-all-dim (the softmax scale) moved no printed digit of
#: 1f1b's losses; at 0.1 it moves lm loss by 4e-4 at iteration 1.
USERS_ARCHITECTURE = ("--init-method-std", "0.1", "--swiglu", "--normalization", "RMSNorm",
                      "--untie-embeddings-and-output-weights", "--disable-bias-linear")
#: DeepSeek-V3's MoE at tiny sizes: layer 1 dense, 4 experts of which top-2 in 2 groups (1 group
#: picked), sigmoid scores with expert bias, routed output scaled by 2.5, one shared expert, and the
#: sequence-wise auxiliary loss (its coefficient large enough to move the printed loss).
V3_MOE = (*MOE_EP2, "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
          "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-router-score-function", "sigmoid",
          "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
          "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
          "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2")
#: 4 layers: 2 per stage under 1f1b and dualpipe, 1 per V-stage under dualpipev (whose first V-stage
#: holds the dense layer); data parallel 2 for the dense layers, 4 micro-batches of 2 per iteration
#: (2 per direction).
V3 = (*MLA_YARN, *USERS_ARCHITECTURE, *V3_MOE, "--num-layers", "4", "--train-iters", "4",
      "--ckpt-format", "torch_dist")


def _assert_expert_biases_equal(got_out, ref_bias, what, iterations):
    """Every copy of every router's expert_bias after each of ``iterations`` equals 1f1b's (the only
    value it printed), and the bias moved."""
    bias = {key: v for key, v in expert_biases(got_out).items() if key[0] in iterations}
    ref = {key: v for key, v in ref_bias.items() if key[0] in iterations}
    print(f"{what}: expert_bias: " + "; ".join(f"iteration {it} layer {layer}: {sorted(v)}"
                                                for (it, layer), v in sorted(bias.items())))
    assert sorted(bias) == sorted(ref), (sorted(bias), sorted(ref))
    for key, values in sorted(ref.items()):
        assert len(values) == 1 and bias[key] == values, (key, bias[key], values)
    assert any(set(v) - set("0.,-") for vs in bias.values() for v in vs), "expert_bias never moved"


# core_v0.19.0 only in CI (61 s of the oldest tier's budget); at core_v0.16.1 it passed on 2026-11-27
# (MEGATRON_LM_PATH=... .venv/bin/python -m pytest -k v3_recipe): the oldest tier keeps MLA + YaRN and MTP.
def test_v3_recipe_dualpipe_and_dualpipev_equal_1f1b(tmp_path):
    """The whole V3 recipe: dualpipe from the start and dualpipev from 1f1b's checkpoint of
    iteration 2, every printed metric (lm loss, the sequence-wise load-balancing loss, grad norm,
    params norm, zeros) and every expert_bias equal to Megatron's own 1f1b."""
    ref_ckpt = str(tmp_path / "1f1b")
    ref = run_pretrain("1f1b", *V3, "--save", ref_ckpt, "--save-interval", "2", with_metrics=True,
                       **PRINT_EXPERT_BIAS)
    ref_bias = expert_biases(LAST_OUTPUT[0])
    assert "seq_load_balancing_loss" in ref[1], ref[1]  # the sequence-wise aux loss is printed

    got = run_pretrain("dualpipe", *V3, with_metrics=True, **PRINT_EXPERT_BIAS)
    what = "V3 recipe: dualpipe vs 1f1b"
    assert_metrics_close(got, ref, what)
    _assert_expert_biases_equal(LAST_OUTPUT[0], ref_bias, what, (1, 2, 3, 4))

    _set_latest(ref_ckpt, 2)
    got = run_pretrain("dualpipev", *V3, "--load", ref_ckpt, with_metrics=True, **PRINT_EXPERT_BIAS)
    what = "V3 recipe: dualpipev from 1f1b's checkpoint of iteration 2 vs 1f1b"
    assert_metrics_close(got, _as_resumed_at(ref, 2), what)
    _assert_expert_biases_equal(LAST_OUTPUT[0], ref_bias, what, (3, 4))


@pytest.mark.smoke
def test_mla_with_yarn_dualpipe_equals_1f1b():
    """YaRN RoPE (``--rotary-scaling-factor``, ``--mscale``, ``--mscale-all-dim``) in multi-latent
    attention runs in the CPU mode at both tags, dualpipe equal to 1f1b in every printed metric
    (pp = 4, dense)."""
    args = (*MLA_YARN, *USERS_ARCHITECTURE, "--train-iters", "3")
    ref = run_pretrain("1f1b", *args, with_metrics=True)
    got = run_pretrain("dualpipe", *args, with_metrics=True)
    worst = assert_metrics_close(got, ref, "MLA + YaRN: dualpipe vs 1f1b")
    assert "lm loss" in worst


def _offers_yarn_positions():
    """Whether the checkout's ``--position-embedding-type`` takes ``yarn`` (core_v0.19.0 does)."""
    with open(os.path.join(MEGATRON_LM_PATH, "megatron", "training", "arguments.py")) as f:
        return "'learned_absolute', 'rope', 'yarn'" in f.read()


@pytest.mark.skipif(not HAVE_MEGATRON_LM or not _offers_yarn_positions(),
                    reason="--position-embedding-type yarn came with core_v0.19.0")
def test_yarn_positions_dualpipe_equals_1f1b():
    """YaRN for standard attention with partial rotary, another base, --rotary-scaling-factor and
    sequences twice its original length: dualpipe equal to 1f1b in every printed metric (pp = 4)."""
    args = ("--position-embedding-type", "yarn", "--rotary-base", "500000", "--rotary-percent", "0.5",
            "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "32", "--mscale-all-dim",
            "1.0", *USERS_ARCHITECTURE, "--train-iters", "3")
    ref = run_pretrain("1f1b", *args, with_metrics=True)
    got = run_pretrain("dualpipe", *args, with_metrics=True)
    worst = assert_metrics_close(got, ref, "YaRN positions: dualpipe vs 1f1b")
    assert "lm loss" in worst

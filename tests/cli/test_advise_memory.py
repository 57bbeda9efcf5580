"""advise's memory and its launch gate: every option that changes a rank's memory counts, the
flagship DeepSeek-V3 config fits its GPUs at its stated count, a launch that does not fit is
refused naming the schedule that does.

The tensor-by-tensor activation model reduces to Megatron-LM's own formula for the layer that
formula assumes (multi-head attention, a 4h GELU MLP); tests/mcore/test_activation_memory_measured.py
checks the rest against what autograd keeps on CPU."""
import subprocess
import sys

import pytest

from megatron_dualpipe.cli.advise_model import config_argv, no_fit_hint
from megatron_dualpipe.costs import activation_memory as am
from megatron_dualpipe.costs import model_cost as mc
from megatron_dualpipe.costs.model_args import parse

BASE = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
        "--vocab-size", "32000", "--pipeline-model-parallel-size", "4"]


@pytest.mark.parametrize("tp,sp", [(1, False), (4, True), (4, False)])
def test_megatrons_layer_is_megatrons_formula(tp, sp):
    m = parse(BASE + ["--tensor-model-parallel-size", str(tp)] + (["--sequence-parallel"] if sp else []))
    h, f = m.hidden, m.ffn_hidden
    ours = am.layer_bytes(m, False)
    theirs = (h * (18 + 4 * f / h) / tp) if sp else h * (10 + 24 / tp)  # Korthikanti et al., Table 2
    print(f"\ntp={tp} sp={sp}: ours {ours / h:.3f}h per token, Megatron's {theirs / h:.3f}h")
    assert ours == pytest.approx(theirs)


MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512",
       "--moe-shared-expert-intermediate-size", "512", "--swiglu", "--multi-latent-attention", "--q-lora-rank", "256",
       "--kv-lora-rank", "128", "--qk-head-dim", "64", "--qk-pos-emb-head-dim", "32", "--v-head-dim", "64"]


@pytest.mark.parametrize("module", ["layernorm", "mla_up_proj", "moe_act", "moe", "shared_experts", "core_attn"])
def test_each_recompute_module_frees_its_tensors_and_costs_its_forward(module):
    plain = parse(BASE + MOE)
    recomputed = parse(BASE + MOE + ["--recompute-granularity", "selective", "--recompute-modules", module])
    freed = sum(t.bytes for t in am.layer_tensors(plain, True) if module in t.freed_by)
    saved = am.layer_bytes(plain, True) - am.layer_bytes(recomputed, True)
    gpu = mc.GPUS["H100"]
    extra = mc.stage_costs(recomputed, gpu, 0.4, 8, 1).b - mc.stage_costs(plain, gpu, 0.4, 8, 1).b
    print(f"\n{module}: frees {saved:.0f} bytes per token per layer (its tensors: {freed:.0f}); backward +{extra:.4f} ms")
    assert saved == pytest.approx(freed)
    assert (saved > 0) == (module != "core_attn")  # no s x s scores are modelled (flash attention)
    assert (extra > 0) == (module in ("mla_up_proj", "moe", "shared_experts", "core_attn"))


def test_fp8_keeps_gemm_inputs_in_one_byte_and_full_recompute_keeps_the_input():
    m = parse(BASE + MOE)
    fp8 = parse(BASE + MOE + ["--fp8-format", "hybrid"])
    halved = sum(t.bytes for t in am.layer_tensors(m, True) if t.gemm_input) / 2
    print(f"\nfp8 saves {am.layer_bytes(m, True) - am.layer_bytes(fp8, True):.0f} of {halved:.0f} bytes per token")
    assert am.layer_bytes(m, True) - am.layer_bytes(fp8, True) == pytest.approx(halved)
    full = parse(BASE + MOE + ["--recompute-granularity", "full", "--recompute-method", "uniform"])
    assert am.layer_bytes(full, True) == 2 * m.hidden


def test_the_output_layer_is_kept_once_and_mtp_per_micro_batch():
    m = parse(BASE + MOE + ["--mtp-num-layers", "1"])
    per, once = mc.stage_activations(m, m.pp - 1)
    plain_per, plain_once = mc.stage_activations(parse(BASE + MOE), m.pp - 1)
    print(f"\nlast stage: {per / 1e6:.1f} MB per micro-batch + {once / 1e6:.1f} MB once (no MTP: "
          f"{plain_per / 1e6:.1f} + {plain_once / 1e6:.1f})")
    assert once == pytest.approx(2 * plain_once) and per > plain_per


def _advise(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_dualpipe", "advise", *argv], capture_output=True,
                          text=True, timeout=120)


def test_deepseek_v3_fits_80_gb_at_its_stated_count_and_a_launch_that_does_not_is_refused():
    """2048 H800 (256 x 8), PP16 x EP64: dualpipe fits with the config's recomputation and shared
    shard group; at 512 GPUs (EP32) it does not and the launch gate names dualpipev, which does."""
    fits = _advise("--config", "moe_deepseek_v3", "--gpu", "H800", "--nodes", "256", "--launch-check",
                   "--", "--pipeline-schedule", "dualpipe")
    print("\n" + fits.stdout + fits.stderr)
    assert fits.returncode == 0 and "SCHEDULE=dualpipe fits" in fits.stdout
    gb = float(fits.stdout.split("fits (")[1].split(" GB")[0])
    print(f"margin {80 - gb:.2f} GB")
    assert gb < 80
    over = _advise("--config", "moe_deepseek_v3", "--gpu", "H800", "--nodes", "64", "--launch-check",
                   "--", "--pipeline-schedule", "dualpipe")
    print(over.stdout + over.stderr)
    assert over.returncode == 3 and "use SCHEDULE=dualpipev" in over.stderr and "MEMORY_CHECK=0" in over.stderr
    assert len([x for x in over.stderr.splitlines() if "error" in x]) == 1


def test_the_shared_shard_group_counts_the_optimizer_state_once():
    argv = config_argv("moe_deepseek_v3", 256, 8)
    m = parse(argv)
    assert m.shared_shard  # the config's dualpipe default
    text = _advise("--config", "moe_deepseek_v3", "--gpu", "H800", "--nodes", "256", "--json").stdout
    import json

    rows = {o["schedule"]: o for o in json.loads(text)["choices"][0]["options"]}
    one = rows["1f1b"]["parameter_memory"]
    mem = mc.heaviest_memory(m, 2048)
    print(f"\n1f1b {one:.2f} GB, dualpipe {rows['dualpipe']['parameter_memory']:.2f} GB, optimizer {mem.optimizer / 1e9:.2f}")
    assert rows["dualpipe"]["parameter_memory"] == pytest.approx(2 * one - mem.optimizer / 1e9)


def test_the_all_to_all_overlap_is_assumed_only_with_its_flag():
    off = _advise("--config", "moe_mixtral_8x7b", "--gpu", "H100", "--nodes", "8").stdout
    on = _advise("--config", "moe_mixtral_8x7b", "--gpu", "H100", "--nodes", "8", "--",
                 "--overlap-moe-expert-parallel-comm").stdout
    line = next(x for x in off.splitlines() if x.startswith("the all-to-all overlap"))
    print("\n" + line)
    assert "with it" in line and "Megatron's interleaved 1F1B with it" in line
    assert "interleaved-1f1b-a2a (needs --overlap-moe-expert-parallel-comm" in off
    assert "interleaved-1f1b-a2a" in on.split("schedule ")[-1] and "the all-to-all overlap" not in on


def test_nothing_fits_suggests_only_what_the_run_can_still_change():
    m = parse(BASE + MOE + ["--recompute-granularity", "selective", "--recompute-modules", "layernorm",
                            "--use-distributed-optimizer", "--dualpipe-shared-shard-group"])
    hint = no_fit_hint(m, 80)
    print("\n" + hint)
    assert "--micro-batch-size" not in hint and "shared-shard" not in hint and "layernorm mla_up_proj moe moe_act" in hint
    assert "--micro-batch-size 2" in no_fit_hint(parse(BASE + ["--micro-batch-size", "4"]), 80)


def test_activation_offloading_moves_its_modules_inputs_off_the_gpu_and_only_megatrons_schedules_run_it():
    """megatron-core 0.19's --fine-grained-activation-offloading: each --offload-modules entry's
    tensors leave the GPU; the plugin's schedules refuse the flag, so advise compares Megatron's own."""
    plain = parse(BASE + MOE)
    off = parse(BASE + MOE + ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "expert_fc1"])
    moved = [t for t in am.layer_tensors(plain, True) if am.offloaded(off, t)]
    print(f"\noffloaded: {[t.what for t in moved]}")
    assert {t.what for t in moved} >= {"query after up-projection and RoPE", "tokens dispatched to experts (top-k copies)"}
    assert am.layer_bytes(plain, True) - am.layer_bytes(off, True) == pytest.approx(sum(t.bytes for t in moved))
    out = _advise("--config", "moe_mixtral_8x7b", "--gpu", "H100", "--nodes", "8", "--",
                  "--fine-grained-activation-offloading", "--offload-modules", "core_attn").stdout
    assert "dualpipe (refuses --fine-grained-activation-offloading" in out and "use interleaved-1f1b" in out
    with pytest.raises(Exception, match="needs --offload-modules"):
        parse(BASE + ["--fine-grained-activation-offloading"])

"""The cost model's FLOPs and memory against Megatron-LM's own figures, for three models: a dense
GQA model (gpt_8b, with sequence parallel and selective recomputation: Megatron's first activation
formula), Mixtral 8x7B (MoE, expert parallel, no sequence parallel: the second formula) and a
DeepSeek-V3-like model (MLA, 3 dense + 61 MoE layers with a shared expert, MTP).

Megatron-LM's side: its ``parse_args`` / ``validate_args`` on the same arguments (the world size
of each layout), then ``megatron.training.training.num_floating_point_operations`` and
``theoretical_memory_usage.report_theoretical_memory``, in one child process (needs
``MEGATRON_LM_PATH``; skipped when unset). Ours: :mod:`megatron_dualpipe.costs.model_cost` on
:func:`~megatron_dualpipe.costs.model_args.parse` of the same arguments. Megatron's weight
memory (core_v0.19.0's accounting; 0.16.1's is older, printed only) is its most loaded shard, which it takes as the average stage's layers plus the MTP block
and one embedding: our per-stage parameters are summed the same way for the comparison, and our
own heaviest stage is printed beside it."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from megatron_dualpipe.costs import model_cost as mc
from megatron_dualpipe.costs.model_args import parse

ROOT = pathlib.Path(__file__).resolve().parents[2]
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")
MB = 1024 * 1024

_COMMON = ("--swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --bf16 "
           "--use-distributed-optimizer --lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer "
           "--micro-batch-size 1 --position-embedding-type rope").split()
#: name -> (world size, pretrain_gpt.py arguments)
MODELS = {
    "gpt_8b": (16, "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
                   "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
                   "--vocab-size 128256 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 "
                   "--sequence-parallel --recompute-granularity selective --global-batch-size 512"),
    "mixtral_8x7b": (64, "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
                         "--group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings "
                         "4096 --vocab-size 32000 --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type "
                         "alltoall --pipeline-model-parallel-size 8 --expert-model-parallel-size 8 "
                         "--global-batch-size 256"),
    "deepseek_v3_like": (512, "--num-layers 64 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
                              "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
                              "--qk-pos-emb-head-dim 64 --v-head-dim 128 --seq-length 4096 "
                              "--max-position-embeddings 4096 --vocab-size 129280 --num-experts 256 "
                              "--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 "
                              "--moe-router-topk 8 --moe-layer-freq ([0]*3+[1]*61) --moe-token-dispatcher-type "
                              "alltoall --mtp-num-layers 1 --pipeline-model-parallel-size 16 "
                              "--expert-model-parallel-size 32 --global-batch-size 4096"),
}


def argv(name):
    return _COMMON + MODELS[name][1].split()


_CHILD = """
import contextlib, io, json, os, sys
from megatron_dualpipe.launch import validation as launch_validation
root, cases = sys.argv[1], json.loads(sys.argv[2])
out = {}
for name, (world, argv) in cases.items():
    os.environ["WORLD_SIZE"] = str(world)
    with contextlib.redirect_stdout(io.StringIO()):
        launch_validation._install(root)
        args = launch_validation._parse_and_validate(os.path.join(root, "pretrain_gpt.py"), argv)
        try:
            from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding as pad
        except ImportError:
            from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding as pad
        args.padded_vocab_size = pad(args.vocab_size, args, logging_enabled=False)
        from megatron.training.training import num_floating_point_operations
        from megatron.training.theoretical_memory_usage import report_theoretical_memory
        flops = num_floating_point_operations(args, args.global_batch_size)
        m = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        weights, activations, _ = report_theoretical_memory(args, num_microbatches=m)
    from megatron.core.package_info import __version__
    out[name] = dict(flops=flops, weights_mb=weights, activations_mb=activations, microbatches=m,
                     padded_vocab=args.padded_vocab_size, version=__version__)
print("@@" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def megatron():
    if not MEGATRON_LM_PATH:
        pytest.skip("MEGATRON_LM_PATH is not set")
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONPATH=str(ROOT))
    cases = {n: (world, argv(n)) for n, (world, _) in MODELS.items()}
    proc = subprocess.run([sys.executable, "-c", _CHILD, MEGATRON_LM_PATH, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("@@")]
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line[-1][2:])


def megatron_style_weights(m, world):
    """Our parameters summed as Megatron's most loaded shard: the average stage's layers and final
    norm, the MTP block, one embedding."""
    layers = mc.Params()
    for s in range(m.pp):
        layers = layers + mc.stage_params(m, s)[0]
    norm = mc.Params(replicated=(1 if m.normalization == "RMSNorm" else 2) * m.hidden)
    _, _, mtp = mc.stage_params(m, m.pp - 1)
    shard = (layers + norm).scaled(1 / m.pp) + mtp + mc.Params(m.hidden * m.padded_vocab)
    return sum(mc.rank_bytes(m, shard, world))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_flops_and_memory_equal_megatrons_own(megatron, name):
    world = MODELS[name][0]
    m = parse(argv(name))
    theirs = megatron[name]
    micro = theirs["microbatches"]
    ours = dict(flops=mc.iteration_flops(m, m.global_batch), weights_mb=megatron_style_weights(m, world) / MB,
                activations_mb=mc.activation_bytes(m) * min(micro, m.pp) / MB, padded_vocab=m.padded_vocab)
    heaviest = mc.heaviest_memory(m, world)
    print(f"\n{name} (M={micro}):")
    for key in ("flops", "weights_mb", "activations_mb", "padded_vocab"):
        print(f"  {key:15s} megatron {theirs[key]:.6g}  ours {ours[key]:.6g}")
    print(f"  our heaviest stage ({heaviest.stage}): states {heaviest.states / MB:.6g} MB")
    if tuple(int(x) for x in theirs["version"].split(".")[:2]) < (0, 19):
        # core_v0.16.1's accounting divides every parameter by TP and none by EP (0.19 splits them)
        print(f"  weights not compared: megatron-core {theirs['version']}'s report_theoretical_memory predates the "
              f"TP/replicated/EP split of core_v0.19.0")
        ours.pop("weights_mb")
    for key, value in ours.items():
        assert value == pytest.approx(theirs[key], rel=1e-9), key

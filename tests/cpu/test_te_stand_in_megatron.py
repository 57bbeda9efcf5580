"""megatron-core's Transformer Engine layer spec runs on the CPU mode's TE stand-in with the numerics of
its local spec, and ``delay_wgrad_compute`` defers exactly the TE layers' weight gradients to the W step.

One fresh interpreter (tests/cpu/te_stand_in_worker.py) builds both specs with the same weights: a tiny
GPT (also with dropout), a tiny MoE (TE's grouped experts against the local sequential ones), and the TE
GPT with deferred weight gradients under megatron DDP, driven by the plugin's W step
(``mcore.wgrad.TEQueues``); two more ranks run both specs tensor parallel (with and without sequence
parallelism).
Under whichever megatron-core this interpreter has (CI runs the suite with 0.16.1 and with 0.19.2).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_dualpipe.launch.ports import free_port

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-mode tests; on a GPU machine CPU mode is never active"
)

RTOL = 1e-5
BF16_RTOL = 1e-3  # one BF16 rounding step is 2 ** -8 = 3.9e-3 of a value
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_stand_in_worker.py")


def run_worker(*args):
    done = subprocess.run([sys.executable, WORKER, str(free_port()), *args], capture_output=True, text=True,
                          timeout=600)
    found = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and found, (done.stdout + done.stderr)[-4000:]
    return json.loads(found[-1][len("RESULTS "):])


@pytest.fixture(scope="module")
def results():
    """The worker's single-rank cases, run once for this file."""
    return run_worker()


def check(case, rtol=RTOL):
    for line in case["lines"]:
        print(f"  {line}")
    assert case["loss"] <= rtol and case["grads"] <= rtol, case["lines"]


def test_the_stand_in_claims_the_te_release_of_this_megatron_core(results):
    from importlib.metadata import version

    claimed, megatron_sees = results["te_version"]
    print(f"  transformer_engine.__version__ {claimed}, megatron's get_te_version() {megatron_sees}")
    major_minor = tuple(int(p) for p in version("megatron-core").split(".")[:2])
    assert claimed == megatron_sees == ("2.17.0" if major_minor >= (0, 19) else "2.11.0")


@pytest.mark.parametrize("case", ["dense", "moe", "dropout", "dense bf16", "moe bf16"])
def test_te_spec_equals_local_spec_on_the_same_weights(results, case):
    """Losses and every parameter's gradient, two micro-batches (MoE: TEGroupedMLP vs SequentialMLP)."""
    check(results[case], BF16_RTOL if "bf16" in case else RTOL)


def test_te_spec_equals_local_spec_tensor_and_sequence_parallel():
    """tp=2 over gloo, each rank's shards: dense and MoE with sequence parallelism, dense without."""
    found = run_worker("tp2")
    for name, case in sorted(found.items()):
        print(f"  {name}:")
        check(case)
    assert len(found) == 6


@pytest.mark.parametrize("case", ["deferred", "deferred_fused", "deferred_moe", "deferred_megatron_layers"])
def test_deferred_te_weight_gradients_arrive_in_w_and_equal_the_local_spec(results, case):
    """Two backwards leave the TE layers' main_grad at zero; one W per backward (the plugin's, or
    megatron-core's layers' backward_dw) fills it (directly with fuse_wgrad_accumulation), equal to the
    local spec's undeferred gradients; every queue ends empty."""
    found = results[case]
    print(f"  |main_grad| of the TE layers' {found['weights']} weights before W: {found['before_w']}; "
          f"{found['pushed_per_backward']} contexts pushed per backward onto {found['queued_modules']} queues")
    assert found["before_w"] == 0.0 and found["weights"] == (8 if case in ("deferred", "deferred_fused") else 20)
    # per layer: qkv, proj, fc1, fc2 (MoE: qkv, proj, the grouped fc1 and fc2 of the experts)
    assert found["queued_modules"] == found["pushed_per_backward"] == 8
    check(found)


def test_deferred_bias_gradients_fail_in_w_where_transformer_engine_fails(results):
    """With biases, TE's backward_dw sets a bias's gradient only if it is still None and its GEMM computed
    none for a returned bias: B W B W works while DDP leaves the bias gradient to the module's hook, B B W W
    (or a bias megatron re-created under use_cpu_initialization) raises in W, in TE and in the stand-in."""
    found = results["bias_order"]
    print(f"  {found}")
    assert found == {"BWBW": "AttributeError TERowParallelLinear / AttributeError TERowParallelLinear",
                     "BWBW remarked": "ok / ok", "BBWW remarked": "AttributeError TERowParallelLinear"}

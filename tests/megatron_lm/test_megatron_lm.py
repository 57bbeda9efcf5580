"""Megatron-LM (``megatron.training`` / ``pretrain_gpt.py``) integration tests.

They need a Megatron-LM checkout at tag ``core_v0.16.1``: set ``MEGATRON_LM_PATH`` to its
directory (the one holding ``pretrain_gpt.py``). Without it every test here is skipped.
Megatron-LM's training code also imports ``six``, ``regex``, ``yaml`` (pyyaml) and ``pydantic``,
and building its dataset helper needs ``pybind11`` and a C++ compiler.

Everything Megatron-related runs in subprocesses, so this pytest process never imports
``megatron.training`` nor gets the CPU redirections installed.
"""

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from megatron_dualpipe.megatron_lm.patching import patch_file
from megatron_dualpipe.versions import checkout_core_version, installed_core_version, tag_of
from megatron_dualpipe.versions import parse as parse_version

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")
SKIP_MESSAGE = "set MEGATRON_LM_PATH to a Megatron-LM checkout at tag core_v0.16.1"

pytestmark = pytest.mark.skipif(
    not MEGATRON_LM_PATH or not os.path.isfile(os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py")),
    reason=SKIP_MESSAGE,
)

_REQUIRED = {"six": "six", "regex": "regex", "yaml": "pyyaml", "pydantic": "pydantic"}


def _require_training_deps(extra=()):
    missing = [pkg for mod, pkg in list(_REQUIRED.items()) + list(extra) if importlib.util.find_spec(mod) is None]
    if missing:
        pytest.skip(f"Megatron-LM's training code needs: pip install {' '.join(missing)}")


def _env(**extra):
    """The argument cases' subprocess: the package, Megatron-LM and the tests' harness importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, MEGATRON_LM_PATH, os.path.join(REPO_ROOT, "tests"), env.get("PYTHONPATH")) if p
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------
# Arguments: parse_args + validate_args of the real Megatron-LM, in one subprocess
# ------------------------------------------------------------------------------------------

BASE = [
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--transformer-impl", "local", "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion", "--distributed-backend", "gloo",
    "--use-cpu-initialization", "--train-iters", "5", "--lr", "1e-3",
    "--pipeline-model-parallel-size", "4",
]  # fmt: skip


MOE_EP2 = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
           "--disable-bias-linear", "--expert-model-parallel-size", "2"]


def _set(argv, flag, value):
    """Replace ``flag``'s value in argv (or append it)."""
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


# name -> (world size, argv, expected: None = accepted, else substrings of the error message[,
#          {args attribute: value} set after Megatron's validation, before the DualPipe checks])
CASES = {
    "default_is_1f1b": (4, BASE, None),
    "dualpipe_ok": (4, BASE + ["--pipeline-schedule", "dualpipe"], None),
    "dualpipev_ok": (4, BASE + ["--pipeline-schedule", "dualpipev"], None),
    "dualpipe_no_zero_bubble_overlap_ok": (
        4,
        BASE + ["--pipeline-schedule", "dualpipe", "--no-dualpipe-zero-bubble", "--overlap-grad-reduce"],
        None,
    ),
    "dualpipe_timeout_ok": (4, BASE + ["--pipeline-schedule", "dualpipe", "--dualpipe-p2p-timeout", "30"], None),
    "advise_executor_1f1b_ok": (4, BASE + ["--pipeline-schedule", "executor-1f1b", "--dualpipe-advise",
                                           "--dualpipe-advise-warmup", "2"], None),
    "advise_megatron_1f1b": (4, BASE + ["--pipeline-schedule", "1f1b", "--dualpipe-advise"],
                             ["--dualpipe-advise measures the executor's schedules", "--pipeline-schedule executor-1f1b"]),
    "1f1b_odd_pp_overlap_untouched": (
        3,
        _set(_set(BASE, "--pipeline-model-parallel-size", "3"), "--num-layers", "6")
        + ["--overlap-grad-reduce", "--mtp-num-layers", "1", "--position-embedding-type", "rope"],
        None,
    ),
    "dualpipe_odd_pp": (
        3,
        _set(_set(BASE, "--pipeline-model-parallel-size", "3"), "--num-layers", "6")
        + ["--pipeline-schedule", "dualpipe"],
        ["even pipeline size", "set --pipeline-model-parallel-size to 4", "got 3"],
    ),
    "dualpipe_pp1": (
        1,
        _set(BASE, "--pipeline-model-parallel-size", "1") + ["--pipeline-schedule", "dualpipe"],
        ["--pipeline-model-parallel-size >= 2"],
    ),
    "dualpipev_pp1": (
        1,
        _set(BASE, "--pipeline-model-parallel-size", "1") + ["--pipeline-schedule", "dualpipev"],
        ["--pipeline-model-parallel-size >= 2"],
    ),
    "dualpipe_vpp_layers": (
        4,
        BASE + ["--pipeline-schedule", "dualpipe", "--num-layers-per-virtual-pipeline-stage", "1"],
        ["--num-layers-per-virtual-pipeline-stage"],
    ),
    "dualpipev_vpp_stages": (
        4,
        BASE + ["--pipeline-schedule", "dualpipev", "--num-virtual-stages-per-pipeline-rank", "2"],
        ["--num-virtual-stages-per-pipeline-rank"],
    ),
    "dualpipe_too_few_microbatches": (
        4,
        _set(BASE, "--global-batch-size", "4") + ["--pipeline-schedule", "dualpipe"],
        ["micro-batches", "got 2", "--global-batch-size", "--micro-batch-size"],
    ),
    "dualpipe_zero_bubble_overlap_grad_reduce_ok": (
        4, BASE + ["--pipeline-schedule", "dualpipe", "--overlap-grad-reduce", "--use-distributed-optimizer",
                   "--overlap-param-gather"], None),
    "dualpipev_no_align_param_gather_ok": (
        4, BASE + ["--pipeline-schedule", "dualpipev", "--overlap-grad-reduce", "--use-distributed-optimizer",
                   "--overlap-param-gather", "--no-align-param-gather"], None),
    "executor_1f1b_overlap_param_gather_ok": (
        4, BASE + ["--pipeline-schedule", "executor-1f1b", "--overlap-grad-reduce", "--use-distributed-optimizer",
                   "--overlap-param-gather"], None),
    "dualpipe_mtp_ok": (
        4,
        BASE
        + ["--pipeline-schedule", "dualpipe", "--mtp-num-layers", "1"]
        + ["--position-embedding-type", "rope"],
        None,
    ),
    "dualpipev_two_mtp_layers_ok": (
        4, BASE + ["--pipeline-schedule", "dualpipev", "--mtp-num-layers", "2", "--position-embedding-type", "rope"], None),
    "dualpipe_layout_ok": (
        4,
        BASE + ["--pipeline-schedule", "dualpipe", "--pipeline-model-parallel-layout", "Ett|tt|tt|ttL"],
        None,
    ),
    "dualpipe_overlap_moe_ok": (
        4,
        _set(BASE, "--pipeline-model-parallel-size", "2") + MOE_EP2 + ["--pipeline-schedule", "dualpipe",
                                                                       "--overlap-moe-expert-parallel-comm"],
        None,
    ),
    "dualpipe_overlap_moe_needs_ep": (
        4,
        BASE + MOE_EP2[:-2] + ["--pipeline-schedule", "dualpipe", "--overlap-moe-expert-parallel-comm"],
        ["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size > 1"],
    ),
    "dualpipe_overlap_moe_mtp_half_precision": (
        4,
        _set(_set(BASE, "--pipeline-model-parallel-size", "2"), "--num-layers", "8") + MOE_EP2
        + ["--pipeline-schedule", "dualpipe", "--overlap-moe-expert-parallel-comm", "--mtp-num-layers", "1",
           "--position-embedding-type", "rope", "--bf16"],
        ["--overlap-moe-expert-parallel-comm", "half precision", "remove --mtp-num-layers"],
    ),
    "dualpipe_overlap_moe_two_mtp_layers": (
        4,
        _set(_set(BASE, "--pipeline-model-parallel-size", "2"), "--num-layers", "8") + MOE_EP2
        + ["--pipeline-schedule", "dualpipe", "--overlap-moe-expert-parallel-comm", "--mtp-num-layers", "2",
           "--position-embedding-type", "rope"],
        ["--overlap-moe-expert-parallel-comm", "at most one MTP layer", "--mtp-num-layers 1"],
    ),
    # the fused units call an MoE layer's parts, never the layer 'moe' recomputes (megatron-core 0.19 refuses it too)
    "dualpipe_overlap_moe_recompute_moe": (
        4,
        _set(BASE, "--pipeline-model-parallel-size", "2") + MOE_EP2
        + ["--pipeline-schedule", "dualpipe", "--overlap-moe-expert-parallel-comm", "--recompute-granularity",
           "selective", "--recompute-modules", "core_attn", "moe"],
        ["--overlap-moe-expert-parallel-comm", "--recompute-modules moe", "remove moe from --recompute-modules"],
    ),
    "dualpipev_overlap_moe_allgather": (
        4,
        _set(_set(BASE, "--pipeline-model-parallel-size", "2"), "--num-layers", "8")
        + _set(MOE_EP2, "--moe-token-dispatcher-type", "allgather")
        + ["--pipeline-schedule", "dualpipev", "--overlap-moe-expert-parallel-comm"],
        ["--moe-token-dispatcher-type alltoall or flex"],
    ),
    "dualpipev_layers_not_divisible": (
        4,
        _set(BASE, "--num-layers", "12") + ["--pipeline-schedule", "dualpipev"],
        ["--num-layers (12)", "2 * pipeline size (8)"],
    ),
    "dualpipe_bad_timeout": (
        4,
        BASE + ["--pipeline-schedule", "dualpipe", "--dualpipe-p2p-timeout", "0"],
        ["--dualpipe-p2p-timeout"],
    ),
    # Uneven V-stages (issue 25, item 3): a layout of 2 * pp V-stages, the embedding and the loss counted
    # as layers of V-stages 0 and 2pp-1; a layout of another count is refused before Megatron-LM's own
    # check with one of the right count, and --decoder-first/last-pipeline-num-layers with their V-stages.
    "dualpipev_layout_ok": (4, BASE + ["--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-layout",
                                       "Et|(t|)*6,tL"], None),
    "dualpipev_layout_of_pp_stages": (
        4, BASE + ["--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-layout", "Ett|tt|tt|ttL"],
        ["has 4 stages", "runs 8 (2 * --pipeline-model-parallel-size 4)", "'Et|(t|)*6,tL'"]),
    "dualpipev_layout_of_3_stages": (
        4, BASE + ["--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-layout", "Ett|ttt|tttL"],
        ["has 3 stages", "'Et|(t|)*6,tL'"]),
    "dualpipe_layout_of_2pp_stages": (
        4, BASE + ["--pipeline-schedule", "dualpipe", "--pipeline-model-parallel-layout", "Et|(t|)*6,tL"],
        ["has 8 stages", "runs 4 (--pipeline-model-parallel-size 4)", "'Ett|tt|tt|ttL'"]),
    "dualpipev_first_last_stage": (
        4, _set(BASE, "--num-layers", "10") + ["--pipeline-schedule", "dualpipev",
                                               "--decoder-first-pipeline-num-layers", "1",
                                               "--decoder-last-pipeline-num-layers", "1"],
        ["V-stages 0 and 4 (ranks 0 and 3)", "--pipeline-model-parallel-layout 'E|t|(tt|)*4,t|L'"]),
    "dualpipev_embedding_and_loss_as_layers_ok": (
        4, _set(BASE, "--num-layers", "6") + ["--pipeline-schedule", "dualpipev",
                                              "--account-for-embedding-in-pipeline-split",
                                              "--account-for-loss-in-pipeline-split"], None),
    "dualpipev_embedding_and_loss_as_layers_uneven": (
        4, _set(BASE, "--num-layers", "10") + ["--pipeline-schedule", "dualpipev",
                                               "--account-for-embedding-in-pipeline-split",
                                               "--account-for-loss-in-pipeline-split"],
        ["(12) does not divide into 2 * --pipeline-model-parallel-size (8)", "'Et|tt|tt|(t|)*4,tL'"]),
    "dualpipe_uneven_stages_ok": (
        4,
        _set(BASE, "--num-layers", "10")
        + ["--pipeline-schedule", "dualpipe", "--decoder-first-pipeline-num-layers", "1",
           "--decoder-last-pipeline-num-layers", "1"],
        None,
    ),
}

MOE_ARGS = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
MTP_ARGS = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]

# Every single-option rule of the options table checked on args (mcore/options.py), as a user would type it. ``argv`` cases go
# through Megatron's own parse_args + validate_args; options that Megatron's own validation refuses
# on a machine without Transformer Engine / CUDA come as ``{attribute: value}`` set on the
# validated args of BASE before the DualPipe checks run (name -> (schedule, argv, overrides)).
REFUSED_CASES = {
    "--use-torch-fsdp2": ("dualpipe", [], {"use_torch_fsdp2": True}),
    "--use-megatron-fsdp": ("dualpipev", [], {"use_megatron_fsdp": True}),
    "--mtp-num-layers with --context-parallel-size > 1": ("dualpipev", MTP_ARGS, {"context_parallel_size": 2}),
    "--mtp-num-layers with --pipeline-model-parallel-layout": (
        "dualpipe", MTP_ARGS, {"pipeline_model_parallel_layout": "Ett|tt|ttm|ttL"}),
    "--cuda-graph-impl / --enable-cuda-graph / --external-cuda-graph": ("dualpipe", [], {"cuda_graph_impl": "local"}),
    "--overlap-moe-expert-parallel-comm": ("executor-1f1b", [], {"overlap_moe_expert_parallel_comm": True}),
    "--iterations-to-skip": ("dualpipe", ["--iterations-to-skip", "2"], None),
    "--adlr-autoresume": ("dualpipev", [], {"adlr_autoresume": True}),  # Megatron's own check imports userlib
    "--sft": ("dualpipe", [], {"sft": True}),
    "--perform-rl-step": ("dualpipev", [], {"perform_rl_step": True}),
    "--hybrid-context-parallel": ("dualpipe", [], {"hybrid_context_parallel": True}),
    "--moe-router-load-balancing-type global_aux_loss": (
        "dualpipe", MOE_ARGS + ["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01"],
        None),
    "--qk-clip": ("dualpipe", [], {"qk_clip": True}),
    "--moe-enable-routing-replay": ("dualpipe", MOE_ARGS + ["--moe-enable-routing-replay"], None),
    "--save-dgrads-interval": ("dualpipev", ["--save-dgrads-interval", "2"], None),
    "--use-ring-exchange-p2p": ("executor-1f1b", ["--use-ring-exchange-p2p"], None),
    "--fine-grained-activation-offloading": ("dualpipe", [], {"fine_grained_activation_offloading": True}),
    "--inprocess-restart": ("dualpipe", ["--inprocess-restart"], None),
    # megatron-core 0.16.1 only (the tier that runs it); at 0.19 the same arguments are accepted.
    "--moe-layer-freq": ("dualpipev", MOE_ARGS + ["--moe-layer-freq", "([1]+[0]*7)"], None),
    "--num-distributed-optimizer-instances": ("zb-h1", [], {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                                                           "num_distributed_optimizer_instances": 2}),
    "--moe-use-upcycling": ("dualpipe", [], {"moe_use_upcycling": True}),
    "--add-bias-linear": ("dualpipe", ["--transformer-impl", "transformer_engine"], {"delay_wgrad_compute": True}),
    "--defer-embedding-wgrad-compute": ("dualpipe", MTP_ARGS, {"defer_embedding_wgrad_compute": True}),
    "--tp-comm-overlap": ("zb-h1", [], {"tp_comm_overlap": True}),
    "--context-parallel-size": ("dualpipe", [], {"context_parallel_size": 2}),
    "--fp8-param-gather": ("dualpipev", [], {"fp8_param_gather": True}),
    "--experimental-attention-variant": ("zb-h1", [], {"experimental_attention_variant": "gated_delta_net"}),
    "--log-max-attention-logit": ("dualpipe", [], {"log_max_attention_logit": True}),
    "--use-precision-aware-optimizer": ("dualpipev", [], {"use_precision_aware_optimizer": True}),
    "--optimizer-cpu-offload": ("dualpipe", [], {"optimizer_cpu_offload": True}),
    "--overlap-param-gather-with-optimizer-step": ("dualpipev", [], {"overlap_param_gather_with_optimizer_step": True}),
    "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank": (
        "executor-1f1b", ["--num-layers-per-virtual-pipeline-stage", "1"], None),
    "--pipeline-model-parallel-layout": ("executor-1f1b", [], {"pipeline_model_parallel_layout": "Ett|tt|tt|ttL"}),
    "--pipeline-model-parallel-layout with --ckpt-format torch_dist": (
        "dualpipev", [], {"pipeline_model_parallel_layout": "Et|(t|)*6,tL", "ckpt_format": "torch_dist",
                          "save": "/nonexistent"}),
    "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers": (
        "zb-h1", [], {"decoder_last_pipeline_num_layers": 2}),
    "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split": (
        "executor-1f1b", [], {"account_for_loss_in_pipeline_split": True}),
    "--init-model-with-meta-device": ("dualpipe", ["--init-model-with-meta-device"], None),
    # megatron-core 0.19's options (set on the validated args, so the case runs at both tags).
    "--moe-paged-stash": ("executor-1f1b", [], {"moe_paged_stash": True}),
    "--moe-expert-rank-capacity-factor": ("dualpipe", [], {"moe_expert_rank_capacity_factor": 1.5}),
    "--fp8-recipe delayed": ("dualpipe", [], {"fp8": "e4m3", "fp8_recipe": "delayed"}),
}

for _flag, (_schedule, _argv, _over) in REFUSED_CASES.items():
    CASES["refused " + _flag] = (4, BASE + ["--pipeline-schedule", _schedule] + _argv, ["does not support " + _flag], _over)
if parse_version(installed_core_version() or "0") >= (0, 19):  # megatron-core 0.19 prints that MoE loss equal
    CASES["refused --moe-layer-freq"] = CASES["refused --moe-layer-freq"][:2] + (None, None)
# FP8's delayed recipe is refused under both (its amax history follows the schedule's order); tensorwise runs.
CASES["fp8 tensorwise_dualpipe_ok"] = (4, BASE + ["--pipeline-schedule", "dualpipe"], None,
                                       {"fp8": "e4m3", "fp8_recipe": "tensorwise"})
CASES["fp8 delayed_dualpipev_refused"] = (4, BASE + ["--pipeline-schedule", "dualpipev"],
                                          ["does not support --fp8-recipe delayed", "use --fp8-recipe tensorwise"],
                                          {"fp8": "e4m3", "fp8_recipe": "delayed"})
CASES["global_aux_loss_dualpipev_ok"] = (
    4, BASE + ["--pipeline-schedule", "dualpipev"] + REFUSED_CASES["--moe-router-load-balancing-type global_aux_loss"][1],
    None)

# --dualpipe-shared-shard-group: accepted with dualpipe and the distributed optimizer; every option it does
# not run with yet is refused naming the flag to change (the rules with needs=SHARED_SHARDS of the options
# table), as is any other schedule.
SHARED = ["--pipeline-schedule", "dualpipe", "--dualpipe-shared-shard-group"]
SHARED_REFUSED_CASES = {  # rule flag -> (argv, {args attribute: value} after Megatron's validation)
    "--use-distributed-optimizer": ([], {"use_distributed_optimizer": False}),
    "--overlap-grad-reduce": (["--overlap-grad-reduce"], None),
    "--overlap-param-gather": (["--overlap-grad-reduce", "--overlap-param-gather"], None),
    "--num-distributed-optimizer-instances": ([], {"num_distributed_optimizer_instances": 2}),
    "--ddp-average-in-collective": (["--ddp-average-in-collective"], None),
    "--ckpt-format": (["--save", "/nonexistent/ckpt", "--save-interval", "2", "--ckpt-format", "torch_dist"], None),
    "--optimizer": ([], {"optimizer": "muon"}),
    "--num-experts with --save / --load": (MOE_ARGS + ["--save", "/nonexistent/ckpt", "--save-interval", "2",
                                                       "--ckpt-format", "torch"], None),
    "--context-parallel-size": ([], {"context_parallel_size": 2}),
    "--expert-tensor-parallel-size": (MOE_ARGS, {"expert_tensor_parallel_size": 2}),
    "--fp16": (["--fp16"], None),
    "--use-precision-aware-optimizer / --fp8-param-gather": ([], {"use_precision_aware_optimizer": True}),
    "--data-parallel-random-init": (["--data-parallel-random-init"], None),
    "--use-nccl-ub": ([], {"use_nccl_ub": True}),
    "--tensor-parallel-num-weight-shards": ([], {"gtp_weight_remat_size": 2}),
}
CASES["shared_shard_group_ok"] = (4, BASE + SHARED + ["--use-distributed-optimizer"], None)
CASES["shared_shard_group_torch_checkpoints_ok"] = (
    4, BASE + SHARED + ["--use-distributed-optimizer", "--save", "/nonexistent/ckpt", "--save-interval", "2",
                        "--ckpt-format", "torch"], None)
CASES["shared_shard_group_needs_dualpipe"] = (
    4, BASE + ["--pipeline-schedule", "dualpipev", "--dualpipe-shared-shard-group", "--use-distributed-optimizer"],
    ["--dualpipe-shared-shard-group shares the distributed optimizer", "use --pipeline-schedule dualpipe"])
for _flag, (_argv, _over) in SHARED_REFUSED_CASES.items():
    CASES["shared shard group refuses " + _flag] = (
        4, BASE + SHARED + ["--use-distributed-optimizer"] + _argv, ["--dualpipe-shared-shard-group: ",
                                                                     _flag.split(" / ")[0]], _over)

# --dualpipe-dp-first: accepted with dualpipe and the distributed optimizer (overlapped reduction and
# gather included); its own refusals (needs=DP_FIRST), another schedule and the shared shard group refused.
DP_FIRST = ["--pipeline-schedule", "dualpipe", "--dualpipe-dp-first"]
DP_FIRST_REFUSED_CASES = {
    "--use-distributed-optimizer": ([], {"use_distributed_optimizer": False}),
    "--num-distributed-optimizer-instances": ([], {"num_distributed_optimizer_instances": 2}),
    "--ddp-reduce-scatter-with-fp32-accumulation": ([], {"ddp_reduce_scatter_with_fp32_accumulation": True}),
}
CASES["dp_first_ok"] = (4, BASE + DP_FIRST + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                               "--overlap-param-gather"], None)
CASES["dp_first_needs_dualpipe"] = (
    4, BASE + ["--pipeline-schedule", "1f1b", "--dualpipe-dp-first", "--use-distributed-optimizer"],
    ["--dualpipe-dp-first reorders the sum", "use --pipeline-schedule dualpipe"])
CASES["dp_first_or_shared_shard_group"] = (
    4, BASE + DP_FIRST + ["--dualpipe-shared-shard-group", "--use-distributed-optimizer"],
    ["--dualpipe-dp-first and --dualpipe-shared-shard-group are two ways", "keep one"])
for _flag, (_argv, _over) in DP_FIRST_REFUSED_CASES.items():
    CASES["dp-first refuses " + _flag] = (
        4, BASE + DP_FIRST + ["--use-distributed-optimizer"] + _argv, ["--dualpipe-dp-first: ", _flag], _over)

# Options that Megatron-LM's own validation stops before training on this machine, under 1f1b as
# under DualPipe: name -> argv (run once per schedule, `test_fails_as_under_1f1b`).
# --moe-grouped-gemm: validate_args asks torch.cuda.get_device_capability() (>= 8), and its
# GroupedMLP needs the CUDA-only grouped_gemm package; Transformer Engine's TEGroupedMLP is GPU too.
FAILS_AS_UNDER_1F1B = {
    "--moe-grouped-gemm": _set(BASE, "--pipeline-model-parallel-size", "2") + MOE_EP2 + ["--moe-grouped-gemm"],
}
SAME_FAILURE_SCHEDULES = ("1f1b", "dualpipe", "dualpipev")

_ARGS_SCRIPT = textwrap.dedent(
    r"""
    import contextlib, io, json, os, sys, traceback
    cases = json.loads(sys.argv[1])
    from megatron_dualpipe import hooks
    from megatron_dualpipe.megatron_lm import arguments, triton_stub
    triton_stub.preimport_triton_users()
    hooks.install(["python"])  # typing.override for core_v0.19.0 on Python 3.11
    import megatron.training.arguments as margs
    import megatron.training.initialize as minit
    from harness import argument_help
    argument_help.read_once()  # ~90 parses: the help texts read at the first

    def run(world, argv, installed, overrides=None):
        if installed:
            arguments.install()
        else:
            arguments.uninstall()
        os.environ["WORLD_SIZE"] = str(world)
        os.environ["RANK"] = "0"
        sys.argv = ["pretrain_gpt.py"] + argv
        # core_v0.16.1: initialize_megatron calls initialize.validate_args (imported by name);
        # core_v0.19.0: parse_and_validate_args calls arguments.validate_args (the one patched there).
        validate = getattr(minit, "validate_args", None) or margs.validate_args
        if overrides:  # Megatron's own checks, then the option, then DualPipe's checks
            validate = getattr(validate, "__wrapped__", validate)
        with contextlib.redirect_stdout(io.StringIO()):
            args = margs.parse_args()
            validate(args, {"tokenizer_type": "GPT2BPETokenizer"})
        if overrides:
            for key, value in overrides.items():
                setattr(args, key, value)
            arguments.validate_dualpipe_args(args)
        return args

    out = {}
    for name, (world, argv, overrides) in cases.items():
        try:
            args = run(world, argv, True, overrides)
            out[name] = {"ok": True, "schedule": args.pipeline_schedule,
                         "zero_bubble": args.dualpipe_zero_bubble,
                         "timeout": args.dualpipe_p2p_timeout, "align_param_gather": args.align_param_gather}
        except BaseException as e:
            out[name] = {"ok": False, "type": type(e).__name__, "msg": str(e),
                         "tb": traceback.format_exc()[-2000:]}
    # 1f1b must leave Megatron's own parsing/validation result unchanged.
    def plain(ns):
        return {k: repr(v) for k, v in sorted(vars(ns).items())}
    stock = plain(run(4, cases["default_is_1f1b"][1], False))
    patched = plain(run(4, cases["default_is_1f1b"][1], True))
    extra = sorted(set(patched) - set(stock))
    diff = sorted(k for k in stock if stock[k] != patched.get(k))
    out["__1f1b_identity__"] = {"extra": extra, "diff": diff}
    print("@@RESULT@@" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def arg_results():
    _require_training_deps()
    cases = {name: [case[0], case[1], case[3] if len(case) > 3 else None] for name, case in CASES.items()}
    cases.update({f"{flag} under {schedule}": [4, argv + ["--pipeline-schedule", schedule], None]
                  for flag, argv in FAILS_AS_UNDER_1F1B.items() for schedule in SAME_FAILURE_SCHEDULES})
    payload = json.dumps(cases)
    proc = subprocess.run(
        [sys.executable, "-c", _ARGS_SCRIPT, payload],
        env=_env(),
        cwd=MEGATRON_LM_PATH,
        capture_output=True,
        text=True,
        timeout=300,
    )
    marker = [l for l in proc.stdout.splitlines() if l.startswith("@@RESULT@@")]
    assert proc.returncode == 0 and marker, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(marker[-1][len("@@RESULT@@"):])


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(CASES))
def test_pipeline_schedule_arguments(arg_results, name):
    expected = CASES[name][2]
    res = arg_results[name]
    if expected is None:
        assert res["ok"], res
        return
    assert not res["ok"], f"{name} was accepted"
    assert res["type"] == "DualPipeArgumentError", res["tb"]
    for fragment in expected:
        assert fragment in res["msg"], (fragment, res["msg"])


#: torch 2.11's new_group (no sort_ranks), as the first GPU check found it (tests/cli/test_torch_and_gpu_requirements.py)
_TORCH_2_11 = textwrap.dedent(
    """
    import torch.distributed as _dist
    def _new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                   group_desc=None, device_id=None):
        raise AssertionError("no group may be built")
    _dist.new_group = _new_group
    """
)


def test_two_chunk_schedules_refuse_a_torch_without_ordered_groups_before_training():
    """Megatron's own validation with the plugin installed, on a torch whose new_group cannot keep
    a rank order: dualpipe and dualpipev stop in one line naming torch >= 2.12; 1f1b runs on."""
    _require_training_deps()
    cases = {name: [*CASES[name][:2], None] for name in ("default_is_1f1b", "dualpipe_ok", "dualpipev_ok")}
    proc = subprocess.run([sys.executable, "-c", _TORCH_2_11 + _ARGS_SCRIPT, json.dumps(cases)], env=_env(),
                          cwd=MEGATRON_LM_PATH, capture_output=True, text=True, timeout=300)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("@@RESULT@@")]
    assert proc.returncode == 0 and marker, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(marker[-1][len("@@RESULT@@"):])
    for name in cases:
        print(f"\n{name}: {'accepted' if res[name]['ok'] else res[name]['msg']}")
    assert res["default_is_1f1b"]["ok"]
    for name, schedule in (("dualpipe_ok", "dualpipe"), ("dualpipev_ok", "dualpipev")):
        assert not res[name]["ok"] and res[name]["type"] == "DualPipeArgumentError", res[name]
        assert f"--pipeline-schedule {schedule}: needs torch >= 2.12" in res[name]["msg"], res[name]["msg"]


@pytest.mark.parametrize("flag", sorted(FAILS_AS_UNDER_1F1B))
def test_fails_as_under_1f1b(arg_results, flag):
    """Under DualPipe(V) the option stops before training exactly as under Megatron's own 1f1b
    (on this CPU machine: Megatron's validate_args; on a GPU both are accepted)."""
    results = {s: arg_results[f"{flag} under {s}"] for s in SAME_FAILURE_SCHEDULES}
    outcome = {s: (r["ok"], r.get("type"), r.get("msg")) for s, r in results.items()}
    print(f"\n{flag}: " + "; ".join(f"{s}: {'accepted' if ok else f'{t}: {m}'}" for s, (ok, t, m) in outcome.items()))
    assert len(set(outcome.values())) == 1, outcome
    if not results["1f1b"]["ok"] and flag == "--moe-grouped-gemm":
        assert "get_device_capability" in results["1f1b"]["tb"], results["1f1b"]["tb"]


@pytest.mark.smoke
def test_every_refused_option_has_a_case():
    sys.path.insert(0, REPO_ROOT)
    from megatron_dualpipe.mcore import options

    refused = options.args_rules()  # the single options megatron_lm.arguments refuses on args
    assert sorted(opt.flag for opt in refused) == sorted(REFUSED_CASES)
    print("\nrefused: " + ", ".join(opt.flag for opt in refused))

    shared = [rule.flag for rule in options.REFUSED if rule.needs == options.SHARED_SHARDS]
    assert sorted(shared) == sorted(SHARED_REFUSED_CASES)
    dp_first = [rule.flag for rule in options.REFUSED if rule.needs == options.DP_FIRST]
    assert sorted(dp_first) == sorted(DP_FIRST_REFUSED_CASES)


def test_argument_defaults(arg_results):
    assert arg_results["default_is_1f1b"] == {
        "ok": True, "schedule": "1f1b", "zero_bubble": True, "timeout": None, "align_param_gather": False
    }
    assert arg_results["dualpipe_no_zero_bubble_overlap_ok"]["zero_bubble"] is False
    assert arg_results["dualpipe_timeout_ok"]["timeout"] == 30.0


def test_two_chunk_schedules_keep_align_param_gather(arg_results):
    """Megatron's validate_args turns --align-param-gather off without a virtual pipeline; dualpipe and
    dualpipev give the user's value back (the executor calls param_sync_func for their two chunks),
    the one-chunk executor-1f1b keeps Megatron's (as does 1f1b: test_1f1b_leaves_megatron_args_unchanged)."""
    got = {name: arg_results[name]["align_param_gather"] for name in (
        "dualpipe_zero_bubble_overlap_grad_reduce_ok", "dualpipev_no_align_param_gather_ok",
        "executor_1f1b_overlap_param_gather_ok", "default_is_1f1b")}
    print(f"\nalign_param_gather after validation: {got}")
    assert got == {"dualpipe_zero_bubble_overlap_grad_reduce_ok": True, "dualpipev_no_align_param_gather_ok": False,
                   "executor_1f1b_overlap_param_gather_ok": False, "default_is_1f1b": False}


def test_1f1b_leaves_megatron_args_unchanged(arg_results):
    res = arg_results["__1f1b_identity__"]
    assert res["extra"] == ["dualpipe_advise", "dualpipe_advise_warmup", "dualpipe_dp_first",
                            "dualpipe_drift_check_interval", "dualpipe_p2p_timeout", "dualpipe_shared_shard_group", "dualpipe_zero_bubble",
                            "pipeline_schedule"]
    assert res["diff"] == []


# ------------------------------------------------------------------------------------------
# pretrain_gpt.py, unmodified, on CPU: torchrun + launcher, pp=4, Megatron's 1F1B
# ------------------------------------------------------------------------------------------

_LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: (\S+) \|")


def parse_lm_losses(log: str):
    """``{iteration: lm loss}`` from Megatron's ``training_log`` lines."""
    return {int(m.group(1)): float(m.group(3)) for m in _LOSS_RE.finditer(log)}


def test_parse_lm_losses():
    line = (
        " [2026-11-21 23:19:52.319262] iteration        1/       5 | consumed samples:    16 | "
        "learning rate: 1.000000E-03 | global batch size:    16 | lm loss: 5.568037E+00 | "
        "loss scale: 1.0 | grad norm: 1.863 |"
    )
    losses = parse_lm_losses(line + "\n" + line.replace("1/", "2/").replace("5.568037E+00", "NAN"))
    assert sorted(losses) == [1, 2]
    assert losses[1] == 5.568037 and math.isnan(losses[2])


def test_pretrain_gpt_cpu_pp4_1f1b():
    """pretrain_gpt.py, unmodified, trains on CPU through the launcher under Megatron's own 1F1B
    (pp=4). The run is megatron_lm_runs' plain ``1f1b`` run, the reference that
    test_megatron_lm_dualpipe.py compares every schedule with: made once per session."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        pytest.skip("needs torch")
    if torch.cuda.is_available():
        pytest.skip("this test exercises the CPU mode (no CUDA device must be visible)")
    _require_training_deps(extra=[("pybind11", "pybind11")])
    if shutil.which("make") is None or shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("building Megatron's dataset helper needs make and a C++ compiler")
    from megatron_lm_runs import TINY, launch

    rc, log = launch("1f1b")
    assert rc == 0, log[-6000:]
    iters = int(TINY[TINY.index("--train-iters") + 1])
    losses = parse_lm_losses(log)
    assert sorted(losses) == list(range(1, iters + 1)), log[-6000:]
    for it, loss in losses.items():
        assert math.isfinite(loss), (it, loss)
        assert 0.0 < loss < 20.0, (it, loss)
    assert "megatron_dualpipe CPU mode" in log


def test_patch_applies():
    if shutil.which("git") is None:
        pytest.skip("needs git")
    patch = os.path.join(REPO_ROOT, patch_file(tag_of(checkout_core_version(MEGATRON_LM_PATH))))  # the checkout's tag
    proc = subprocess.run(
        ["git", "apply", "--check", "--reverse", patch], cwd=MEGATRON_LM_PATH, capture_output=True, text=True
    )
    if proc.returncode == 0:
        return  # already applied
    proc = subprocess.run(
        ["git", "apply", "--check", patch], cwd=MEGATRON_LM_PATH, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr

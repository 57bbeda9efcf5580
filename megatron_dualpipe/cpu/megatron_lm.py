"""CPU redirections for Megatron-LM's training loop (``pretrain()`` in ``megatron/training``).

With these and the megatron-core ones (:mod:`.mcore`), the *unmodified* ``pretrain_gpt.py`` of
Megatron-LM ``core_v0.16.1`` and ``core_v0.19.0`` trains on CPU with ``--distributed-backend gloo``: meant for tests
and debugging of the plugin (tiny models, ``--transformer-impl local``), not for speed.
:data:`REDIRECTIONS` is the list, each with its reason; an entry that holds at one of the
two tags only says so in its ``versions`` (megatron-core's version, which the checkout carries).
"""

from __future__ import annotations

import functools

from .redirection import Versions, replace, torch_view, wrap
from .torch_view import GroupedGemmCapableView, scoped_cuda_identity

_TRAINING = "megatron.training.training"
_INITIALIZE = "megatron.training.initialize"
_UTILS = "megatron.training.utils"
#: core_v0.16.1 only: at core_v0.19.0 ``megatron.training.utils`` is a package whose CUDA sites
#: are in ``utils.common_utils``, ``get_batch_on_this_tp_rank`` lives in ``megatron.core.utils``
#: (CPU view of :mod:`.mcore`; no ``.cuda()`` left in it) and ``megatron.legacy`` is gone.
_UNTIL_019 = Versions(below="0.19")
_DIST_UTILS = "megatron.training.models.dist_utils"
_SINCE_019 = Versions("0.19")

#: Argument switches turned off in CPU mode: they need CUDA / apex kernels or run
#: ``torch.compile`` (Megatron's ``jit_fuser``), which would compile C++ with inductor on every
#: rank. The unfused paths compute the same functions.
#: (``--gradient-accumulation-fusion`` stays: the CPU mode stands in for apex's wgrad GEMM and
#: Transformer Engine's ``main_grad`` fusion, ``cpu/stand_ins``.)
FUSION_FLAGS = (
    "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
    "apply_rope_fusion", "cross_entropy_loss_fusion",
)  # fmt: skip


def disable_fusions(args):
    """Turn the :data:`FUSION_FLAGS` off; returns the names that were on (printed on rank 0)."""
    changed = [f for f in FUSION_FLAGS if getattr(args, f, False)]
    for f in changed:
        setattr(args, f, False)
    if changed and getattr(args, "rank", 0) == 0:
        print("megatron_dualpipe CPU mode: no CUDA, turning off fused kernels: " + ", ".join(changed),
              flush=True)
    return changed


def _validate_then_disable_fusions(validate_args):
    @functools.wraps(validate_args)
    def validate(args, *a, **kw):
        result = validate_args(args, *a, **kw)
        disable_fusions(result if result is not None else args)
        return result

    return validate


def _allow_no_cuda(initialize_megatron):
    @functools.wraps(initialize_megatron)
    def initialize(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return initialize


def _forward_step_without_cuda(pretrain):
    """``pretrain`` whose ``forward_step_func`` (its fourth argument) runs under
    :func:`.torch_view.scoped_cuda_identity`."""

    @functools.wraps(pretrain)
    def wrapped(*args, **kwargs):
        if "forward_step_func" in kwargs:
            kwargs["forward_step_func"] = scoped_cuda_identity(kwargs["forward_step_func"])
        elif len(args) > 3:
            args = (*args[:3], scoped_cuda_identity(args[3]), *args[4:])
        return pretrain(*args, **kwargs)

    return wrapped


def _do_nothing(*args, **kwargs):
    return None


def multi_tensor_l2norm_in_fp32(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``multi_tensor_l2norm`` as Transformer Engine's and apex's kernels compute it (every GPU run
    has one of them): squares accumulated in fp32. Megatron's fallback without them norms each
    tensor in its own dtype and stacks the norms in that dtype, so an fp16 model's params norm
    kept about 3 digits per rank, and a schedule that groups the stages on the ranks otherwise
    (DualPipeV) printed another 4th digit."""
    import torch

    squares = [t.detach().float().pow(2).sum() for tensors in tensor_lists for t in tensors]
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    return total.reshape(1), None


# Modules whose global ``torch`` becomes the CPU view, with the CUDA sites on the pretrain path.
_VIEWS = (
    (_TRAINING,
     "start-time MIN all-reduces of device='cuda' tensors in pretrain; "
     "model_module.cuda(torch.cuda.current_device()) and the DDP-init side stream in get_model; "
     "empty_cache in train_step; loss accumulators and memory_stats in training_log; the "
     "do_train/do_valid/do_test broadcast; eval_iters tensors"),
    (_INITIALIZE,
     "device_count() == 1 makes _initialize_distributed build the model-parallel groups and "
     "_set_random_seed seed the RNG tracker; set_device; "
     "MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=current_device()))"),
    ("megatron.training.checkpointing",
     "iteration all-reduce and the torch.cuda RNG state in the checkpoint (--save / --load)"),
)  # fmt: skip

#: Every Megatron-LM redirection, in the order it is applied (after :mod:`.mcore`'s).
REDIRECTIONS = (
    wrap(_TRAINING, "initialize_megatron", _allow_no_cuda,
         "asserts torch.cuda.is_available() ('Megatron requires CUDA.') unless allow_no_cuda=True, "
         "which pretrain() does not pass"),
    *(torch_view(module, why) for module, why in _VIEWS),
    torch_view(_UTILS, "get_batch_on_this_tp_rank receive buffers on current_device(); "
               "reduce_max_stat_across_model_parallel_group, logical_and_across_model_parallel_group, "
               "report_memory, calc_params_l2_norm", _UNTIL_019),
    torch_view(_DIST_UTILS, "the model build moved here in 0.19 (pretrain_gpt.py builds through a config "
               "container): model_module.cuda(current_device()) and the DDP-init side stream in _ddp_wrap", _SINCE_019),
    wrap("megatron.training.models.gpt", "unimodal_build_distributed_models", scoped_cuda_identity,
         "model_module.cuda(...) (0.19's get_model, called by name from GPTModelBuilder): Tensor.cuda / "
         "Module.cuda are the identity during this call only", _SINCE_019),
    wrap("megatron.training", "pretrain", _forward_step_without_cuda,
         "core_v0.19.0's pretrain_gpt.get_batch moves the batch with batch[key].cuda(non_blocking=True) itself: "
         "its forward_step runs with Tensor.cuda the identity (the name pretrain_gpt.py imports; the launcher "
         "enables CPU mode before the script runs)", _SINCE_019),
    torch_view(_UTILS + ".common_utils", "the same functions, moved here in 0.19 (device='cuda' norm and stat "
               "tensors, memory report)", _SINCE_019),
    replace(_UTILS, "multi_tensor_l2norm", multi_tensor_l2norm_in_fp32,
            "the params norm without TE / apex: Megatron's local fallback keeps an fp16 model's norm in fp16; "
            "the kernels of a GPU run accumulate in fp32", _UNTIL_019),
    replace(_UTILS + ".common_utils", "multi_tensor_l2norm", multi_tensor_l2norm_in_fp32,
            "the same name, moved here in 0.19", _SINCE_019),
    wrap(_TRAINING, "get_model", scoped_cuda_identity,
         "model_module.cuda(...): Tensor.cuda / Module.cuda are the identity during this call only"),
    wrap(_TRAINING, "evaluate", scoped_cuda_identity,
         "torch.tensor(...).cuda() loss accumulators (identity during this call only)"),
    wrap(_UTILS, "get_batch_on_this_tp_rank", scoped_cuda_identity,
         "data[...].cuda(non_blocking=True) (identity during this call only)", _UNTIL_019),
    wrap(_TRAINING, "get_batch_on_this_tp_rank", scoped_cuda_identity,
         "the same function imported by name (pretrain_gpt.py imports it by name at import time, "
         "which is why the launcher enables CPU mode before running the script)", _UNTIL_019),
    replace(_INITIALIZE, "_warmup_jit_function", _do_nothing,
            'allocates its warm-up inputs with device="cuda" to pre-compile the fused kernels, '
            "which CPU mode turns off"),
    replace("megatron.legacy.fused_kernels", "load", _do_nothing,
            "at this tag it only runs nvcc -V and creates a build directory; loads no kernel", _UNTIL_019),
    replace("megatron.training.arguments", "torch", GroupedGemmCapableView(),
            "validate_args asks torch.cuda.get_device_capability() >= 8 for --moe-grouped-gemm (its only "
            "device question): the CPU mode's grouped_gemm stand-in runs those kernels"),
    wrap("megatron.training.arguments", "validate_args", _validate_then_disable_fusions,
         "after validation, the fused-kernel switches are turned off: " + ", ".join(FUSION_FLAGS)),
    wrap(_INITIALIZE, "validate_args", _validate_then_disable_fusions,
         "the by-name copy that initialize_megatron calls"),
)  # fmt: skip

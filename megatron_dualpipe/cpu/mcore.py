"""CPU redirections for megatron-core 0.16.1 (local layer spec, no Transformer Engine, no apex).

Found by running tiny GPT / MoE models forward and backward, megatron-core's own 1F1B with
pp = 2 and 4, megatron DDP with ``finalize_model_grads``, its optimizers and the ``torch_dist``
checkpoint writer on gloo. :data:`REDIRECTIONS` is the list, each with its reason; the
replacement functions are below it.

Not redirected (not needed by those paths): ``torch.autocast("cuda")`` in ``forward_step``
(only with ``config.enable_autocast``), grouped-gemm experts, shared-expert overlap streams.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os

import torch

from .redirection import Versions, define_if_missing, replace, torch_view, wrap
from .torch_view import generator_state_for, scoped_cuda_identity, scoped_cuda_type_names, scoped_record_stream_noop

_RANDOM = "megatron.core.tensor_parallel.random"
_CLIP = "clip_grad_by_total_norm_fp32"
_ASYNC_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_DIST_OPT = "megatron.core.optimizer.distrib_optimizer"


def _cpu_rng_tracker_class(original):
    """``CudaRNGStatesTracker`` whose named states are CPU default-generator states."""
    from megatron.core.tensor_parallel import random as mc_random

    default_name = mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME

    class CpuRNGStatesTracker(original):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = generator_state_for(seed)

        @contextlib.contextmanager
        def fork(self, name=default_name):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            gen = torch.default_generator
            orig_state = gen.get_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            gen.set_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f"current state name {self._current_state_name} is not the same as "
                        f"the desired state name {name}."
                    )
                self.states_[name] = gen.get_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                gen.set_state(orig_state)
                self._current_state_name = orig_name

    CpuRNGStatesTracker.__qualname__ = CpuRNGStatesTracker.__name__
    return CpuRNGStatesTracker


def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    """megatron-core's helper, also for CPU tensors: split sizes become numpy when asked."""
    if torch.is_tensor(tensor):
        tensor = tensor.detach().to("cpu")
        if as_numpy:
            return tensor.numpy().copy()
    return tensor


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's ``clip_grad_by_total_norm_fp32`` checking the dtype, not the CUDA type."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is None:
            continue
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        assert grad.dtype in allowed, f"expected an fp32 gradient, got {grad.dtype}"
        grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _torch_norm_with_sequence_parallel(original_new):
    """``WrappedTorchNorm`` that accepts sequence parallelism the way apex's ``FusedLayerNorm`` does:
    the same torch norm, its parameters marked ``sequence_parallel`` so that
    ``finalize_model_grads`` sums their gradients over the tensor-parallel group (each rank saw
    only its slice of the sequence)."""

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, *args, **kwargs)
        config.sequence_parallel = False  # only for the torch norm's own assertion
        try:
            norm = original_new(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return staticmethod(__new__)


def _write_results_queue_without_spawn(original):
    """``filesystem_async._get_write_results_queue`` with a fork-context Manager instead of spawn."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def _get_write_results_queue(mp_mode="spawn"):  # 0.19 names the context (get_write_results_queue)
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return filesystem_async._results_queue

    return _get_write_results_queue


def _optimizer_state_before_loading(sharded_state_dict):
    """``DistributedOptimizer.sharded_state_dict`` that gives a torch optimizer (no apex / TE) its
    state before building the load template, as Megatron does itself for ``fsdp_dtensor``."""
    from megatron.core.optimizer import distrib_optimizer

    @functools.wraps(sharded_state_dict)
    def with_state(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        if is_loading and not distrib_optimizer.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()  # replaced by the loaded values
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return sharded_state_dict(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    return with_state


def _load_with_the_checkpoint_step(load_state_dict):
    """``DistributedOptimizer.load_state_dict`` under ``no_grad``, after which every parameter's
    torch-optimizer ``step`` is its own tensor holding the checkpoint's step."""
    from megatron.core.optimizer import distrib_optimizer

    @functools.wraps(load_state_dict)
    def load(self, state_dict):
        with torch.no_grad():
            result = load_state_dict(self, state_dict)
        if not distrib_optimizer.HAVE_APEX_OR_TE:
            (step,) = {group["step"] for group in state_dict["optimizer"]["param_groups"]}
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(float(step), dtype=torch.float32)
        return result

    return load


def _under_no_grad(method):
    """``method`` run under ``torch.no_grad()``."""

    @functools.wraps(method)
    def under_no_grad(*args, **kwargs):
        with torch.no_grad():
            return method(*args, **kwargs)

    return under_no_grad


def _step_kept_when_not_given(set_states):
    """``DistributedOptimizer._set_main_param_and_optimizer_states`` that leaves torch Adam's
    per-parameter ``step`` as it is when the given states have none (``distrib_optim.pt`` holds
    param, exp_avg, exp_avg_sq; the step comes from the param groups, see the load wrapper)."""

    @functools.wraps(set_states)
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state.get(main, {})
        if "step" in state and "step" not in tensors:
            tensors = dict(tensors, step=state["step"])
        return set_states(self, model_param, tensors)

    return set_main_param_and_optimizer_states


def _taking_head_dims(init):
    """``DotProductAttention.__init__`` that takes multi-latent attention's ``k_channels`` (query
    and key head size) and ``v_channels`` (value head size), as Transformer Engine's attention does:
    its forward already multiplies whatever head sizes it gets, only the output's width
    (``hidden_size_per_partition``) and the default softmax scale come from ``kv_channels``."""
    import math

    @functools.wraps(init)
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        if k_channels is not None and kwargs.get("softmax_scale") is None:
            kwargs["softmax_scale"] = 1.0 / math.sqrt(k_channels)
        init(self, *args, **kwargs)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return __init__


def _te_classes_present(have_te):
    """``HAVE_TE`` of multi_latent_attention, false where its TE names are placeholders, not classes."""
    from megatron.core.transformer import multi_latent_attention

    return bool(have_te) and isinstance(getattr(multi_latent_attention, "TELinear", None), type)


def process_memory() -> int:
    """Resident memory of this process in bytes (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# Modules whose global ``torch`` becomes the CPU view, with the CUDA sites that need it.
def get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
    """The CPU generator's state: on CPU it is the generator the RNG tracker's "CUDA" states live in."""
    return torch.get_rng_state()


def set_cuda_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


_VIEWS = (
    ("megatron.core.pipeline_parallel.schedules",
     'total_num_tokens = torch.zeros(..., device="cuda") in every forward_backward_* function'),
    ("megatron.core.pipeline_parallel.p2p_communication",
     "receive buffers on torch.cuda.current_device(); torch.cuda.synchronize() after batched P2P"),
    ("megatron.core.tensor_parallel.mappings",
     "all-gather / reduce-scatter outputs on torch.cuda.current_device() (MoE token dispatch "
     "with ep > 1; tensor / sequence parallel regions with tp > 1)"),
    ("megatron.core.tensor_parallel.layers",
     "sequence-parallel all-gather buffers on torch.cuda.current_device() (tp > 1)"),
    ("megatron.core.transformer.utils",
     'get_default_causal_mask / sliding-window mask: torch.ones(..., device="cuda") (the local '
     "softmax uses it when the attention mask is None)"),
    ("megatron.core.transformer.moe.router",
     "router weights moved to torch.cuda.current_device() in gating(); expert-bias buffers"),
    ("megatron.core.transformer.moe.moe_utils",
     'aux-loss logging tracker allocates torch.zeros(..., device="cuda")'),
    ("megatron.core.transformer.multi_token_prediction",
     'the MTP loss-logging tracker allocates torch.zeros(..., device=torch.cuda.current_device()) '
     "(--mtp-num-layers)"),
    ("megatron.core.transformer.moe.token_dispatcher",
     "the alltoall dispatcher creates a torch.cuda.Stream() for device-to-host copies"),
    ("megatron.core.transformer.moe.shared_experts",
     "--moe-shared-expert-overlap: the shared experts run on a torch.cuda.Stream() of their own"),
    ("megatron.core.extensions.transformer_engine",
     "the TE layers (on the CPU mode's Transformer Engine stand-in) are placed on "
     "torch.cuda.current_device() without --use-cpu-initialization; FP8 extra state calls "
     "torch.cuda.synchronize()"),
    ("megatron.core.distributed.param_and_grad_buffer",
     'DDP param/grad buffers on torch.cuda.current_device(); warm-up tensor on "cuda"; '
     "communication-stream waits on torch.cuda.default_stream()"),
    ("megatron.core.distributed.distributed_data_parallel",
     "a torch.cuda.Stream for grad-reduce overlap; synchronize / empty_cache in the buffer "
     "free / allocate helpers"),
    ("megatron.core.utils",
     "GlobalMemoryBuffer.get_tensor (DotProductAttention's matmul buffer) allocates on "
     'torch.cuda.current_device(); local_multi_tensor_l2_norm returns a device="cuda" tensor '
     "(the grad norm without apex); check_param_hashes_across_dp_replicas"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding",
     "RotaryEmbedding moves inv_freq to torch.cuda.current_device() in forward (--position-embedding-type "
     "rope; MLA's MultimodalRotaryEmbedding builds it there)"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
     "YarnRotaryEmbedding (--rope-type yarn, MLA) the same, for its two inverse-frequency tables"),
    ("megatron.core.timers",
     "torch.cuda.synchronize() in Timer.start/stop (barrier timers); the all-gather buffer of "
     "timer values"),
    ("megatron.core.rerun_state_machine",
     "result-validation tensors on 'cuda' and the CUDA RNG state it saves"),
    ("megatron.core.optimizer.optimizer",
     "FP32Optimizer._scale and the mixed-precision found_inf / _scale_one buffers are "
     "device='cuda' tensors"),
    (_DIST_OPT,
     "load_state_dict allocates the fresh optimizer's dummy states on torch.cuda.current_device() "
     "(--use-distributed-optimizer resumed from a --ckpt-format torch checkpoint)"),
    ("megatron.core.optimizer.clip_grads",
     "grad-norm and zero-count accumulators on 'cuda'"),
    ("megatron.core.optimizer.grad_scaler",
     "loss-scale tensors on 'cuda' (fp16)"),
    (_ASYNC_WRITER,
     "the torch_dist writer calls torch.cuda.synchronize() before copying tensors to host"),
    # The combined forward-backward step (--overlap-moe-expert-parallel-comm, mcore.overlap).
    ("megatron.core.pipeline_parallel.utils",
     "combined step: set_streams() makes a compute and a communication torch.cuda.Stream; every "
     "ScheduleNode runs in torch.cuda.stream(...) between NVTX ranges"),
    ("megatron.core.models.common.model_chunk_schedule_plan",
     "combined step: a torch.cuda.Event per schedule plan, current_stream(), NVTX ranges per layer"),
    ("megatron.core.models.gpt.fine_grained_callables",
     "combined step: record_stream(torch.cuda.current_stream()) in the MoE combine, "
     "torch.cuda.nvtx.range around weight gradients"),
    ("megatron.core.pipeline_parallel.combined_1f1b",
     "combined step: the loss node runs on torch.cuda.current_stream()"),
    ("megatron.core.dist_checkpointing.strategies.state_dict_saver",
     "torch_dist save: the reuse check and the failure all-reduce use device='cuda' / "
     "current_device() tensors"),
    ("megatron.core.dist_checkpointing.strategies.fully_parallel",
     "fully parallel save / load (Megatron's default for torch_dist) synchronize the CUDA device"),
)  # fmt: skip

#: Every megatron-core redirection, in the order it is applied.
REDIRECTIONS = (
    wrap(_RANDOM, "CudaRNGStatesTracker", _cpu_rng_tracker_class,
         "add()/fork() use torch.cuda RNG state; a subclass keeps the named states of the CPU "
         "generator (model_parallel_cuda_manual_seed and get_cuda_rng_tracker().fork() work)"),
    replace(_RANDOM, "_CUDA_RNG_STATE_TRACKER", None,
            "a tracker built before CPU mode is of the CUDA class: dropped, so that the next "
            "get_cuda_rng_tracker() builds the CPU one"),
    replace(_RANDOM, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False,
            "goes with the dropped tracker"),
    wrap("megatron.core.models.common.language_module.language_module",
         "LanguageModule.setup_embeddings_and_output_layer", scoped_cuda_identity,
         "weight.data.cuda() for tied embeddings with pp > 1; Tensor.cuda / Module.cuda are the "
         "identity during this call only"),
    wrap("megatron.core.optimizer.grad_scaler", "DynamicGradScaler.load_state_dict", scoped_cuda_identity,
         "--fp16 resumed from a checkpoint: the loaded loss scale is moved with .cuda(current_device()); "
         "Tensor.cuda is the identity during this call only"),
    define_if_missing("megatron.core.transformer.moe.moe_utils", "te_general_gemm", None,
                      "RouterGatingLinearFunction (every MoE router) tests `te_general_gemm is not "
                      "None`, but the name is bound only when Transformer Engine imports "
                      "(NameError without TE)"),
    replace("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
            maybe_move_tensor_to_cpu,
            "converts only CUDA tensors, so the alltoall split sizes stay tensors on the CPU and "
            "all_to_all_single rejects them; CPU tensors become numpy when as_numpy=True"),
    replace("megatron.core.optimizer.clip_grads", _CLIP, clip_grad_by_total_norm_fp32,
            "asserts grad.type() == 'torch.cuda.FloatTensor'; the replacement checks the dtype "
            "and scales the same grads by the same max_norm / (total_norm + 1e-6)"),
    replace("megatron.core.optimizer.optimizer", _CLIP, clip_grad_by_total_norm_fp32,
            "the by-name import that MegatronOptimizer.step calls (--clip-grad > 0)"),
    # Activation recompute (--recompute-granularity full / selective): CheckpointFunction saves and
    # restores the CUDA RNG state around the recomputed forward.
    replace(_RANDOM, "_get_cuda_rng_state", get_cuda_rng_state,
            "activation recompute saves the CUDA RNG state (torch.cuda.random.get_rng_state); on CPU "
            "that is the CPU generator, where the tracker's states live"),
    replace(_RANDOM, "_set_cuda_rng_state", set_cuda_rng_state,
            "and restores it for the recomputed forward"),
    wrap("megatron.core.pipeline_parallel.combined_1f1b", "combined_forward_backward_step",
         scoped_record_stream_noop,
         "its schedule nodes and the MoE combine call Tensor.record_stream, which the CPU backend "
         "lacks (NotImplementedError); a no-op for CPU tensors during this call only"),
    wrap("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__", _torch_norm_with_sequence_parallel,
         "the local spec's norm without apex asserts 'sequence parallel not supported by torch "
         "LayerNorm'; with --sequence-parallel it is built as apex's FusedLayerNorm would be: "
         "parameters marked sequence_parallel, gradients summed over the tensor-parallel group"),
    wrap("megatron.core.transformer.dot_product_attention", "DotProductAttention.__init__", _taking_head_dims,
         "--multi-latent-attention builds its core attention with k_channels / v_channels (query-key and "
         "value head sizes), which only Transformer Engine's attention takes: the local spec's "
         "DotProductAttention raised TypeError under Megatron's own 1f1b; taken, the output is "
         "v_channels wide"),
    wrap("megatron.core.transformer.multi_latent_attention", "HAVE_TE", _te_classes_present,
         "megatron-core 0.16.1 sets it when its Transformer Engine extension imports, which it does without "
         "TE, with MagicMock placeholders: MLASelfAttention's isinstance(self.linear_proj, TELinear) raised "
         "TypeError under Megatron's own 1f1b (--multi-latent-attention); 0.19 reads TE's own flag",
         Versions(below="0.19")),
    wrap(_ASYNC_WRITER, "_get_write_results_queue", _write_results_queue_without_spawn,
         "the torch_dist writer's results queue lives in a Manager started with the spawn "
         "method, which re-runs the __main__ script in a new interpreter: under "
         "megatron_dualpipe.launch that is pretrain_gpt.py without the plugin, so the Manager "
         "dies (no triton on a CPU machine) and the save fails with EOFError. A fork-context "
         "Manager runs no script", Versions(below="0.19")),
    wrap(_ASYNC_WRITER, "get_write_results_queue", _write_results_queue_without_spawn,
         "the same queue under its 0.19 name (get_write_results_queue(mp_mode='spawn')): the spawned interpreter "
         "would also fail on core_v0.19.0's typing.override under Python 3.11", Versions("0.19")),
    replace(_ASYNC_WRITER, "_process_memory", process_memory,
            "the torch_dist writer processes call it before their try block; without psutil (not "
            "a Megatron-LM dependency) it raises there, the writer dies before "
            "count_queue.task_done() and the training process waits in count_queue.join() "
            "forever (the torch_dist save hang); reads /proc/self/statm instead"),
    wrap(_DIST_OPT, "DistributedOptimizer.sharded_state_dict", _optimizer_state_before_loading,
         "loading a torch_dist checkpoint with --use-distributed-optimizer builds its template "
         "from state_dict(), which, with torch's Adam (no apex / TE), asserts len(steps) == 1 "
         "while the fresh optimizer has no state yet; dummy states are made first (the loaded "
         "values replace them), as Megatron does for fsdp_dtensor"),
    wrap(_DIST_OPT, "DistributedOptimizer.load_state_dict", _load_with_the_checkpoint_step,
         "with torch's Adam (no apex / TE) and fp32 parameters: (a) it copies the loaded values "
         "into main parameters that are views of the model's leaf parameters outside no_grad "
         "('a view of a leaf Variable that requires grad is being used in an in-place "
         "operation'); (b) it gives every parameter's state the same step tensor, which Adam "
         "then increments once per parameter, and then overwrites that step with the load "
         "template's (a LocalNonpersistentObject), so the bias correction after a resume is "
         "wrong. Runs under no_grad; each state gets its own tensor with the checkpoint's step "
         "(from the param groups)"),
    wrap(_DIST_OPT, "DistributedOptimizer.load_parameter_state_from_dp_zero", _under_no_grad,
         "--ckpt-format torch (distrib_optim.pt): the same in-place copy into main parameters that, "
         "with torch's Adam and fp32 parameters, are views of the model's leaf parameters ('a view "
         "of a leaf Variable that requires grad is being used in an in-place operation'); run under "
         "no_grad"),
    wrap(_DIST_OPT, "DistributedOptimizer.get_parameter_state_dp_zero", scoped_cuda_identity,
         "--dist-ckpt-optim-fully-reshardable gathers the state with use_gloo_comm=False: "
         "send_tensor.cuda(); Tensor.cuda is the identity during this call only"),
    wrap(_DIST_OPT, "DistributedOptimizer._set_main_param_and_optimizer_states", _step_kept_when_not_given,
         "copies every state of torch's Adam, 'step' included, from the given tensors, but "
         "distrib_optim.pt (--ckpt-format torch) has no per-parameter step (KeyError: 'step'); the "
         "step the load already set from the param groups is kept"),
    wrap("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
         scoped_cuda_type_names,
         "sorts parameters by param.type() in ('torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor', "
         "'torch.cuda.FloatTensor') and raises 'Wrapped parameters must be one of torch.cuda...' "
         "otherwise (--bf16 / --fp16); tensor.type() names the CUDA type during this call only"),
    wrap(_DIST_OPT, "DistributedOptimizer.__init__", scoped_cuda_type_names,
         "the same param.type() sort for the sharded main parameters (--use-distributed-optimizer); "
         "tensor.type() names the CUDA type during this call only"),
) + tuple(torch_view(module, why) for module, why in _VIEWS) + (
    torch_view("megatron.core.models.common.utils",
               "combined step: TransformerLayerNode (moved here in 0.19) runs backward_dw in "
               "torch.cuda.stream(self.stream)", Versions("0.19")),
)

"""CPU mode for Megatron-LM's training loop (``pretrain()`` in ``megatron/training``).

:func:`enable` does nothing when ``torch.cuda.is_available()`` is True. On a machine without
CUDA it first calls :func:`megatron_dualpipe.cpu_compat.enable_cpu_mode` (megatron-core model,
RNG tracker and schedules; see that module) and then applies the redirections below, so that the
*unmodified* ``pretrain_gpt.py`` of Megatron-LM ``core_v0.16.1`` trains on CPU with
``--distributed-backend gloo``. It is meant for tests and debugging of the plugin (tiny models,
fp32, ``--transformer-impl local``), not for performance.

Every redirection, and why (targets are module attributes; torch itself is touched only by R3):

R1. ``megatron.training.training.initialize_megatron`` is wrapped to pass ``allow_no_cuda=True``.
    ``initialize_megatron`` asserts ``torch.cuda.is_available()`` ("Megatron requires CUDA.")
    unless that flag is set, and ``pretrain()`` does not set it.
R2. The module-global name ``torch`` of the modules in :data:`TORCH_VIEW_MODULES` is replaced by
    a view of torch (:class:`_TrainingTorchView`). It is the real torch except that

    * ``torch.cuda`` is a stand-in (:class:`_CpuCuda`) for one virtual device that is the CPU:
      ``device_count()`` -> 1, ``current_device()`` -> ``torch.device("cpu")``,
      ``set_device``/``synchronize``/``empty_cache``/``reset_peak_memory_stats`` -> no-op, memory
      statistics -> 0, ``Stream``/``Event``/``stream()``/``current_stream()``/``default_stream()``
      -> inert (the CPU has one in-order stream), ``nvtx`` -> no-op ranges,
      ``get_rng_state``/``set_rng_state``/``manual_seed`` -> the CPU generator.
      ``is_available()`` stays False (honest). ``device_count() == 1`` is what makes
      ``initialize._initialize_distributed`` call ``mpu.initialize_model_parallel`` (it skips it
      with 0 devices, leaving no model-parallel groups) and ``initialize._set_random_seed`` call
      ``model_parallel_cuda_manual_seed`` (the RNG tracker used by dropout forks; cpu_compat
      makes that tracker CPU-based).
    * ``torch.device`` maps CUDA devices (``"cuda"``, ``"cuda:3"``, ``("cuda", 0)``) to the CPU
      and keeps ``isinstance(x, torch.device)`` working, and the factories ``tensor``,
      ``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn``, ``randint``, ``arange``,
      ``zeros_like``, ``ones_like``, ``empty_like``, ``full_like``, ``as_tensor`` map a CUDA
      ``device=`` (string, ``torch.device`` or int ordinal) to the CPU.

    Why each module (the ``device="cuda"`` / ``torch.cuda.*`` sites on the pretrain path):

    * ``megatron.training.training``: start-time MIN all-reduces of ``device='cuda'`` tensors in
      ``pretrain``; ``model_module.cuda(torch.cuda.current_device())`` and the DDP-init side
      stream in ``get_model``; ``torch.cuda.empty_cache`` in ``train_step``; loss-dict
      accumulators and ``torch.cuda.memory_stats`` in ``training_log``; exit-duration flags;
      the ``do_train/do_valid/do_test`` flag broadcast in
      ``build_train_valid_test_data_loaders``; ``eval_iters`` tensors; ``evaluate``.
    * ``megatron.training.utils``: ``get_batch_on_this_tp_rank`` receive buffers on
      ``torch.cuda.current_device()``; ``reduce_max_stat_across_model_parallel_group``,
      ``logical_and_across_model_parallel_group``, ``report_memory``, ``calc_params_l2_norm``.
    * ``megatron.training.initialize``: ``device_count`` / ``set_device`` / RNG seeding (above);
      ``MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=current_device()))``.
    * ``megatron.training.checkpointing``: iteration all-reduce and ``torch.cuda`` RNG state in
      the checkpoint (only with ``--save``/``--load``).
    * ``megatron.core.timers``: ``torch.cuda.synchronize()`` in ``Timer.start/stop`` (barrier
      timers) and the all-gather buffer of timer values.  # TODO(move to cpu_compat)
    * ``megatron.core.rerun_state_machine``: result-validation tensors on ``'cuda'`` and the
      CUDA RNG state it saves.  # TODO(move to cpu_compat)
    * ``megatron.core.distributed.param_and_grad_buffer``: the contiguous param/grad buffers are
      allocated on ``torch.cuda.current_device()`` (and a ``device="cuda"`` warm-up tensor);
      communication-stream waits.  # TODO(move to cpu_compat)
    * ``megatron.core.distributed.distributed_data_parallel``: ``torch.cuda.Stream`` for the
      grad-reduce stream; ``synchronize``/``empty_cache`` in buffer offloading.
      # TODO(move to cpu_compat)
    * ``megatron.core.optimizer.optimizer``: ``FP32Optimizer._scale`` and the mixed-precision
      ``found_inf``/``_scale_one``/overflow buffers are ``device='cuda'`` tensors.
      # TODO(move to cpu_compat)
    * ``megatron.core.optimizer.clip_grads``: grad-norm and zero-count accumulators on
      ``'cuda'``.  # TODO(move to cpu_compat)
    * ``megatron.core.optimizer.grad_scaler``: loss-scale tensors on ``'cuda'`` (fp16 only).
      # TODO(move to cpu_compat)
    * ``megatron.core.utils``: ``local_multi_tensor_l2_norm`` (the no-APEX fallback that
      ``get_grad_norm_fp32`` uses for the grad norm) returns a ``device="cuda"`` tensor;
      ``check_param_hashes_across_dp_replicas``. # TODO(move to cpu_compat)
    * ``megatron.core.tensor_parallel.layers`` / ``megatron.core.tensor_parallel.mappings``:
      sequence-parallel all-gather / reduce-scatter outputs on ``current_device()`` (TP>1
      only). # TODO(move to cpu_compat)
R3. ``Tensor.cuda`` and ``nn.Module.cuda`` return their receiver (already on the CPU) *only while*
    one of these functions runs (restored in ``finally``; the torch globals are untouched
    otherwise): ``megatron.training.training.get_model`` (``model_module.cuda(...)``),
    ``megatron.training.utils.get_batch_on_this_tp_rank`` (also rebound where it was imported
    by name: ``megatron.training.training``; ``pretrain_gpt`` imports it by name at import time,
    which is why the launcher installs before running the script) (``data[...]
    .cuda(non_blocking=True)``), and ``megatron.training.training.evaluate``
    (``torch.tensor(...).cuda()`` loss accumulators). Methods of tensors and modules cannot be
    redirected through a module's ``torch`` name, and on a CPU build they raise "Torch not
    compiled with CUDA enabled".
R7. ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (and its by-name import
    in ``megatron.core.optimizer.optimizer``, which is what ``MegatronOptimizer.step`` calls with
    ``--clip-grad`` > 0, the default) is replaced by :func:`clip_grad_by_total_norm_fp32`: the
    original asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``, which a CPU tensor never
    is. The replacement checks ``dtype == float32`` instead and scales the same grads in place by
    the same coefficient ``max_norm / (total_norm + 1e-6)`` when it is < 1.
    # TODO(move to cpu_compat)
R4. ``megatron.training.initialize._warmup_jit_function`` -> no-op: it allocates its warm-up
    inputs with ``device="cuda"`` and exists only to pre-compile the fused bias-GeLU /
    bias-dropout-add kernels, which R6 turns off.
R5. ``megatron.legacy.fused_kernels.load`` -> no-op: at this tag it only runs ``nvcc -V`` (for
    the CUDA version) and creates a build directory; it loads no kernel. There is no nvcc here.
R6. After argument validation (wrapping ``megatron.training.initialize.validate_args`` and
    ``megatron.training.arguments.validate_args``, outside the DualPipe checks), the fused-kernel
    switches are turned off: ``bias_gelu_fusion``, ``bias_swiglu_fusion``,
    ``bias_dropout_fusion``, ``masked_softmax_fusion``, ``apply_rope_fusion``,
    ``cross_entropy_loss_fusion``, ``gradient_accumulation_fusion`` (a note is printed on rank
    0 for those that were on). They need CUDA/APEX kernels or run ``torch.compile`` (Megatron's
    ``jit_fuser``), which would compile C++ with inductor on every rank; the unfused paths are
    numerically the same functions.

Environment notes (not CPU-specific, see :mod:`.dataset_helpers` and :mod:`.triton_stub`): the
dataset C++ helper is built with the running interpreter's pybind11; ``triton`` may be absent.
"""

import contextlib
import functools
import importlib

import torch

from .. import cpu_compat

_CPU = torch.device("cpu")

#: Modules whose global ``torch`` is replaced by the view (R2).
TORCH_VIEW_MODULES = (
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.initialize",
    "megatron.training.checkpointing",
    # TODO(move to cpu_compat): the megatron-core modules below.
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    # --ckpt-format torch_dist writer: torch.cuda.synchronize() before copying tensors to host.
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)

#: Argument switches turned off in CPU mode (R6).
FUSION_FLAGS = (
    "bias_gelu_fusion",
    "bias_swiglu_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "cross_entropy_loss_fusion",
    "gradient_accumulation_fusion",
)

_MARK = "_megatron_dualpipe_cpu"
_ENABLED = False


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare ordinal means a CUDA device
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu_if_cuda(device):
    return _CPU if _is_cuda_device(device) else device


# ------------------------------------------------------------------------------------------
# R2: the torch view
# ------------------------------------------------------------------------------------------


# The inert stream and event stand-ins are cpu_compat's (one in-order CPU "stream").
_CpuEvent, _CpuStream, _CPU_STREAM = cpu_compat._CpuEvent, cpu_compat._CpuStream, cpu_compat._CPU_STREAM


class _NoNvtx:
    @staticmethod
    def range_push(msg):
        pass

    @staticmethod
    def range_pop():
        pass

    @staticmethod
    def range(msg, *args, **kwargs):
        return contextlib.nullcontext()

    @staticmethod
    def mark(msg):
        pass


def _zero(*args, **kwargs):
    return 0


def _noop(*args, **kwargs):
    return None


class _CpuCuda:
    """``torch.cuda`` for one virtual device that is the CPU (see R2)."""

    Stream = _CpuStream
    Event = _CpuEvent
    nvtx = _NoNvtx()

    is_available = staticmethod(lambda: False)
    device_count = staticmethod(lambda: 1)
    current_device = staticmethod(lambda: _CPU)
    set_device = staticmethod(_noop)
    synchronize = staticmethod(_noop)
    empty_cache = staticmethod(_noop)
    reset_peak_memory_stats = staticmethod(_noop)
    reset_max_memory_allocated = staticmethod(_noop)
    ipc_collect = staticmethod(_noop)
    set_stream = staticmethod(_noop)
    memory_allocated = staticmethod(_zero)
    max_memory_allocated = staticmethod(_zero)
    memory_reserved = staticmethod(_zero)
    max_memory_reserved = staticmethod(_zero)
    device_memory_used = staticmethod(_zero)
    memory_stats = staticmethod(lambda *a, **k: {})
    mem_get_info = staticmethod(lambda *a, **k: (0, 0))
    current_stream = staticmethod(lambda device=None: _CPU_STREAM)
    default_stream = staticmethod(lambda device=None: _CPU_STREAM)
    stream = staticmethod(lambda s=None: contextlib.nullcontext())
    get_rng_state = staticmethod(lambda device=None: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, device=None: torch.set_rng_state(state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))
    manual_seed_all = staticmethod(lambda seed: torch.manual_seed(seed))

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    def __repr__(self):
        return "<torch.cuda stand-in: one virtual device = CPU (megatron_dualpipe cpu_training)>"


class _DeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.device)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, torch.device)

    def __call__(cls, *args, **kwargs):
        dev = torch.device(*args, **kwargs)
        return _CPU if dev.type == "cuda" else dev


class _device(metaclass=_DeviceMeta):
    """``torch.device`` that maps CUDA devices to the CPU."""


_FACTORIES = (
    "tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "randint",
    "arange",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
)


def _factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _TrainingTorchView:
    """The real ``torch`` except for ``cuda``, ``device`` and the tensor factories (R2)."""

    def __init__(self):
        self.cuda = _CpuCuda()
        self.device = _device
        for name in _FACTORIES:
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)

    def __repr__(self):
        return "<torch with CUDA redirected to CPU (megatron_dualpipe.megatron_lm.cpu_training)>"


# ------------------------------------------------------------------------------------------
# R3: scoped .cuda() identity
# ------------------------------------------------------------------------------------------


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _module_cuda(self, device=None):
    return self


@contextlib.contextmanager
def _cuda_methods_are_identity():
    saved = torch.Tensor.cuda, torch.nn.Module.cuda
    torch.Tensor.cuda, torch.nn.Module.cuda = _tensor_cuda, _module_cuda
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.nn.Module.cuda = saved


def _scoped_cuda_identity(fn):
    if getattr(fn, _MARK, False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_methods_are_identity():
            return fn(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


# ------------------------------------------------------------------------------------------
# R1, R4, R5, R6
# ------------------------------------------------------------------------------------------


def _wrap_initialize_megatron(fn):
    if getattr(fn, _MARK, False):
        return fn

    @functools.wraps(fn)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return fn(*args, **kwargs)

    setattr(initialize_megatron, _MARK, True)
    return initialize_megatron


def disable_fusions(args):
    """R6: turn the fused-kernel switches off; returns the names that were on."""
    changed = [f for f in FUSION_FLAGS if getattr(args, f, False)]
    for f in changed:
        setattr(args, f, False)
    if changed and getattr(args, "rank", 0) == 0:
        print(
            "megatron_dualpipe CPU mode: no CUDA, turning off fused kernels: "
            + ", ".join(changed),
            flush=True,
        )
    return changed


def _wrap_validate(fn):
    if getattr(fn, _MARK, False):
        return fn

    @functools.wraps(fn)
    def validate(args, *a, **kw):
        result = fn(args, *a, **kw)
        disable_fusions(result if result is not None else args)
        return result

    setattr(validate, _MARK, True)
    return validate


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """R7: CPU-safe equivalent of megatron-core's ``clip_grad_by_total_norm_fp32``."""
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


def enable() -> bool:
    """Apply R1-R7 (and cpu_compat's core redirections). No-op with CUDA. Idempotent."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True

    from megatron_dualpipe import cpu_compat

    cpu_compat.enable_cpu_mode()

    import megatron.legacy.fused_kernels as fused_kernels
    import megatron.training.arguments as margs
    import megatron.training.initialize as minit
    import megatron.training.training as mtraining
    import megatron.training.utils as mutils

    # R1
    mtraining.initialize_megatron = _wrap_initialize_megatron(mtraining.initialize_megatron)
    # R2
    view = _TrainingTorchView()
    for name in TORCH_VIEW_MODULES:
        importlib.import_module(name).torch = view
    # R3
    mtraining.get_model = _scoped_cuda_identity(mtraining.get_model)
    mtraining.evaluate = _scoped_cuda_identity(mtraining.evaluate)
    mutils.get_batch_on_this_tp_rank = _scoped_cuda_identity(mutils.get_batch_on_this_tp_rank)
    mtraining.get_batch_on_this_tp_rank = mutils.get_batch_on_this_tp_rank
    # R4
    minit._warmup_jit_function = lambda: None
    # R5
    fused_kernels.load = lambda args: None
    # R7
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as moptim

    mclip.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    moptim.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    # R6
    margs.validate_args = _wrap_validate(margs.validate_args)
    minit.validate_args = _wrap_validate(minit.validate_args)

    _ENABLED = True
    return True


def enabled() -> bool:
    return _ENABLED

"""Run megatron-core 0.16.1 (local spec, no Transformer Engine, no apex) on a CPU-only machine.

`enable_cpu_mode()` is the only entry point. It does nothing (and returns False) when
`torch.cuda.is_available()` is True, so product code may call it unconditionally; on a machine
without CUDA it applies the redirections below once (idempotent) and returns True.

Every redirection, and why it is needed (found by running tiny GPT / MoE models forward and
backward, megatron-core's own 1F1B schedule with pp=2 and pp=4, and megatron DDP with
``finalize_model_grads`` on gloo):

1. ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker`` is replaced by a subclass that
   keeps the named RNG states of the CPU default generator (``torch.default_generator``).
   The original ``add``/``fork`` call ``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed``,
   so ``model_parallel_cuda_manual_seed`` fails and every ``get_cuda_rng_tracker().fork()``
   (attention dropout, embedding dropout, MoE experts) fails. An already-created tracker of the
   original class is dropped so that the next ``get_cuda_rng_tracker()`` builds the CPU one.
   ``model_parallel_cuda_manual_seed`` itself then works unchanged (its ``torch.cuda.manual_seed``
   is a lazy no-op on a CPU build).
2. ``megatron.core.utils.GlobalMemoryBuffer.get_tensor`` allocates its buffer on
   ``torch.cuda.current_device()``; replaced by the same code allocating on the CPU.
   ``DotProductAttention`` (local spec) gets its matmul buffer from it.
3. ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings, pp > 1) does
   ``weight.data = weight.data.cuda()`` before the embedding all-reduce. It is wrapped so that
   ``torch.Tensor.cuda`` is the identity *only for the duration of that call* (the one place
   where a torch global is touched, and it is restored in a ``finally``).
4. The module-global name ``torch`` of a few megatron-core modules is replaced by a view of
   ``torch`` (``_CpuTorchView``) that differs from ``torch`` only in:
   ``torch.cuda.current_device()`` -> ``torch.device("cpu")``; ``torch.cuda.synchronize()`` ->
   no-op; ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``stream(...)`` -> inert CPU
   stand-ins (everything runs on one CPU "stream", so waits are no-ops); and the factory
   functions ``zeros``/``empty``/``ones``/``full``/``tensor`` map ``device="cuda"`` (or any CUDA
   device) to the CPU. All other attributes are the real ``torch`` ones. Modules:
   - ``megatron.core.pipeline_parallel.schedules``: ``total_num_tokens`` is created with
     ``device="cuda"`` in every ``forward_backward_*`` function.
   - ``megatron.core.pipeline_parallel.p2p_communication``: receive buffers (and shape
     tensors) on ``torch.cuda.current_device()``; ``torch.cuda.synchronize()`` after batched P2P.
   - ``megatron.core.tensor_parallel.mappings``: ``_gather_along_first_dim``,
     ``_reduce_scatter_along_first_dim`` and friends allocate their outputs on
     ``torch.cuda.current_device()``; the MoE dispatchers use them with ep > 1 (and TP/SP
     regions with tp > 1).
   - ``megatron.core.transformer.utils``: ``get_default_causal_mask`` (and the sliding-window
     mask) build the causal mask with ``device="cuda"``; the local softmax uses it when the
     attention mask passed to ``GPTModel.forward`` is None.
   - ``megatron.core.transformer.moe.router``: router weights are moved to
     ``torch.cuda.current_device()`` in ``gating``; expert-bias / global-aux-loss buffers.
   - ``megatron.core.transformer.moe.moe_utils``: the aux-loss logging tracker allocates with
     ``device="cuda"``.
   - ``megatron.core.transformer.moe.token_dispatcher``: ``MoEAlltoAllTokenDispatcher`` creates a
     ``torch.cuda.Stream()`` for device-to-host copies and switches to it.
   - ``megatron.core.distributed.param_and_grad_buffer``: megatron DDP's parameter and gradient
     buffers are allocated on ``torch.cuda.current_device()`` (and a ``device="cuda"`` warm-up
     tensor); the bucket groups wait on ``torch.cuda.default_stream()``.
   - ``megatron.core.distributed.distributed_data_parallel``: DDP creates a
     ``torch.cuda.Stream`` for overlapped grad reduction; ``torch.cuda.synchronize`` /
     ``empty_cache`` in its buffer free/allocate helpers.
   - the combined forward-backward step (``--overlap-moe-expert-parallel-comm``, used by
     ``megatron_dualpipe.mcore.overlap``):
     ``megatron.core.pipeline_parallel.utils`` (``set_streams`` makes a compute and a
     communication stream; every ``ScheduleNode`` runs in ``torch.cuda.stream(...)`` between
     NVTX ranges),
     ``megatron.core.models.common.model_chunk_schedule_plan`` (a ``torch.cuda.Event`` per
     plan, NVTX ranges per layer),
     ``megatron.core.models.gpt.fine_grained_callables`` (``torch.cuda.current_stream()``,
     ``torch.cuda.nvtx.range``),
     ``megatron.core.pipeline_parallel.combined_1f1b`` (the loss node on
     ``torch.cuda.current_stream()``).
   The view also gives ``torch.cuda.default_stream()`` (the CPU stand-in), a no-op
   ``torch.cuda.empty_cache()`` and no-op NVTX ranges (``torch.cuda.nvtx`` raises on a CPU build).

5. ``megatron.core.transformer.moe.moe_utils.te_general_gemm`` is set to None when it is not
   defined. ``RouterGatingLinearFunction`` (every MoE router's gating, 0.16.1) tests
   ``te_general_gemm is not None``, but the name is only bound when Transformer Engine imports, so
   without TE every MoE forward raises ``NameError: name 'te_general_gemm' is not defined``. (This
   is a megatron-core bug that a GPU machine without TE would hit too; here it is fixed only in
   CPU mode.)

6. ``megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu`` (the name the
   dispatcher imported from ``moe_utils``) converts only CUDA tensors, so on the CPU the
   alltoall dispatcher's ``input_splits``/``output_splits`` stay tensors and
   ``torch.distributed.all_to_all_single`` rejects them (``TypeError: all_to_all_single():
   incompatible function arguments``). Replaced by a version that also turns CPU tensors into
   numpy arrays when ``as_numpy=True``.

7. ``megatron.core.pipeline_parallel.combined_1f1b.combined_forward_backward_step`` is wrapped
   so that ``torch.Tensor.record_stream`` does nothing for CPU tensors *for the duration of that
   call only* (the schedule nodes and the MoE combine call it to keep memory alive across CUDA
   streams; the CPU backend has no such op and raises ``NotImplementedError``).

Not redirected (not needed by the paths above): ``MoEAuxLossAutoScaler.set_loss_scale`` (the
schedules call it with a tensor on the output's device, which is the CPU here; only
``megatron.training`` uses ``device=cuda``), ``torch.autocast("cuda")`` in ``forward_step``
(only with ``config.enable_autocast``), grouped-gemm experts, shared-expert overlap streams,
``megatron.training`` (initialize, optimizers, timers: see
``megatron_dualpipe.megatron_lm.cpu_training``).

``REDIRECTIONS`` holds the same list as ``(target, reason)`` pairs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Tuple

import torch

__all__ = ["enable_cpu_mode", "cpu_mode_active", "REDIRECTIONS"]

# Modules whose global `torch` is replaced by `_CpuTorchView`, with the reason.
_TORCH_VIEW_MODULES: Tuple[Tuple[str, str], ...] = (
    (
        "megatron.core.pipeline_parallel.schedules",
        'total_num_tokens = torch.zeros(..., device="cuda") in every forward_backward_* function',
    ),
    (
        "megatron.core.pipeline_parallel.p2p_communication",
        "P2P receive buffers on torch.cuda.current_device(); torch.cuda.synchronize() after batched P2P",
    ),
    (
        "megatron.core.tensor_parallel.mappings",
        "all-gather / reduce-scatter outputs on torch.cuda.current_device() (MoE token "
        "dispatch with ep > 1; sequence/tensor parallel regions with tp > 1)",
    ),
    (
        "megatron.core.transformer.utils",
        'get_default_causal_mask / sliding-window mask: torch.ones(..., device="cuda") '
        "(used by the local softmax when the attention mask is None)",
    ),
    (
        "megatron.core.transformer.moe.router",
        "router weights moved to torch.cuda.current_device() in gating(); expert-bias buffers",
    ),
    (
        "megatron.core.transformer.moe.moe_utils",
        'aux-loss logging tracker allocates torch.zeros(..., device="cuda")',
    ),
    (
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher creates torch.cuda.Stream() for D2H copies and uses it",
    ),
    (
        "megatron.core.distributed.param_and_grad_buffer",
        "DDP param/grad buffers on torch.cuda.current_device(); warm-up tensor on \"cuda\"; "
        "communication-stream waits on torch.cuda.default_stream()",
    ),
    (
        "megatron.core.pipeline_parallel.utils",
        "combined step: set_streams() makes CUDA streams; ScheduleNode runs in torch.cuda.stream() "
        "between NVTX ranges",
    ),
    (
        "megatron.core.models.common.model_chunk_schedule_plan",
        "combined step: torch.cuda.Event per schedule plan, current_stream(), NVTX ranges per layer",
    ),
    (
        "megatron.core.models.gpt.fine_grained_callables",
        "combined step: record_stream(torch.cuda.current_stream()), torch.cuda.nvtx.range for wgrad",
    ),
    (
        "megatron.core.pipeline_parallel.combined_1f1b",
        "combined step: the loss node runs on torch.cuda.current_stream()",
    ),
    (
        "megatron.core.distributed.distributed_data_parallel",
        "DDP creates a torch.cuda.Stream for grad-reduce overlap; synchronize/empty_cache in "
        "the buffer free/allocate helpers",
    ),
)

REDIRECTIONS: Tuple[Tuple[str, str], ...] = (
    (
        "megatron.core.tensor_parallel.random.CudaRNGStatesTracker",
        "add()/fork() use torch.cuda RNG state; replaced by a tracker of CPU generator states "
        "(model_parallel_cuda_manual_seed and get_cuda_rng_tracker().fork() then work)",
    ),
    (
        "megatron.core.utils.GlobalMemoryBuffer.get_tensor",
        "allocates on torch.cuda.current_device(); DotProductAttention uses it",
    ),
    (
        "megatron.core.models.common.language_module.language_module."
        "LanguageModule.setup_embeddings_and_output_layer",
        "weight.data.cuda() for tied embeddings with pp > 1; torch.Tensor.cuda is the identity "
        "during this call only",
    ),
    (
        "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
        "only converts CUDA tensors, so alltoall split sizes stay tensors on the CPU and "
        "all_to_all_single rejects them; CPU tensors are turned into numpy when as_numpy=True",
    ),
    (
        "megatron.core.pipeline_parallel.combined_1f1b.combined_forward_backward_step",
        "schedule nodes call Tensor.record_stream, which the CPU backend lacks (NotImplementedError); "
        "a no-op for CPU tensors during this call only",
    ),
    (
        "megatron.core.transformer.moe.moe_utils.te_general_gemm",
        "referenced unguarded by RouterGatingLinearFunction but bound only when Transformer "
        "Engine imports (NameError without TE); set to None when missing",
    ),
) + tuple((f"{name}.torch", reason) for name, reason in _TORCH_VIEW_MODULES)

_ACTIVE = False


def cpu_mode_active() -> bool:
    """True once `enable_cpu_mode()` has applied the redirections in this process."""
    return _ACTIVE


def enable_cpu_mode() -> bool:
    """Apply the CPU redirections listed in the module docstring.

    Returns False (and changes nothing) when CUDA is available; True when CPU mode is active.
    Calling it again is harmless.
    """
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True
    _patch_rng_tracker()
    _patch_global_memory_buffer()
    _patch_tied_embedding_setup()
    _define_missing_te_general_gemm()
    _patch_dispatcher_split_sizes()
    _patch_combined_step_record_stream()
    view = _CpuTorchView()
    for name, _ in _TORCH_VIEW_MODULES:
        module = importlib.import_module(name)
        module.torch = view
    _ACTIVE = True
    return True


# --------------------------------------------------------------------------------------------
# 1. RNG tracker on the CPU generator


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mc_random

    base = mc_random.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """`CudaRNGStatesTracker` whose named states are CPU default-generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            gen = torch.default_generator
            orig = gen.get_state()
            gen.manual_seed(seed)
            self.states_[name] = gen.get_state()
            gen.set_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mc_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
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

    mc_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    tracker = mc_random._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, CpuRNGStatesTracker):
        mc_random._CUDA_RNG_STATE_TRACKER = None
        mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


# --------------------------------------------------------------------------------------------
# 2. Global memory buffer on the CPU


def _patch_global_memory_buffer() -> None:
    import operator
    from functools import reduce

    from megatron.core import utils as mc_utils

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required_len:
            buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[(name, dtype)] = buf
        return buf[0:required_len].view(*tensor_shape)

    mc_utils.GlobalMemoryBuffer.get_tensor = get_tensor


# --------------------------------------------------------------------------------------------
# 3. Tensor.cuda() inside tied-embedding setup


def _patch_tied_embedding_setup() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = _tensor_cuda_identity
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = saved

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _tensor_cuda_identity(self, *args, **kwargs):
    return self


# --------------------------------------------------------------------------------------------
# 5. MoE router gating without Transformer Engine


def _define_missing_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# --------------------------------------------------------------------------------------------
# 6. alltoall dispatcher split sizes as numpy on the CPU


def _patch_dispatcher_split_sizes() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.detach().to("cpu")
            if as_numpy:
                return tensor.numpy().copy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# --------------------------------------------------------------------------------------------
# 7. Tensor.record_stream inside the combined forward-backward step


def _patch_combined_step_record_stream() -> None:
    from megatron.core.pipeline_parallel import combined_1f1b

    original = combined_1f1b.combined_forward_backward_step

    @functools.wraps(original)
    def combined_forward_backward_step(*args, **kwargs):
        saved = torch.Tensor.record_stream
        torch.Tensor.record_stream = _record_stream_unless_cpu
        try:
            return original(*args, **kwargs)
        finally:
            torch.Tensor.record_stream = saved

    combined_1f1b.combined_forward_backward_step = combined_forward_backward_step


_RECORD_STREAM = torch.Tensor.record_stream


def _record_stream_unless_cpu(self, stream):
    if self.device.type != "cpu":
        _RECORD_STREAM(self, stream)


# --------------------------------------------------------------------------------------------
# 4. A view of `torch` for selected megatron-core modules

_CPU = torch.device("cpu")


def _cpu_if_cuda(device):
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if torch.device(device).type == "cuda":
        return _CPU
    return device


class _CpuEvent:
    """Inert stand-in for `torch.cuda.Event`: work on the CPU is already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _CpuStream:
    """Inert stand-in for `torch.cuda.Stream`: the CPU has one in-order stream."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


_CPU_STREAM = _CpuStream()


class _NoNvtx:
    """`torch.cuda.nvtx` without NVTX: ranges are no-ops."""

    @staticmethod
    def range_push(msg):
        pass

    @staticmethod
    def range_pop():
        pass

    @staticmethod
    def range(msg, *args, **kwargs):
        return contextlib.nullcontext()


class _CpuCudaView:
    """`torch.cuda` with the device, stream and synchronize calls redirected to the CPU."""

    Stream = _CpuStream
    Event = _CpuEvent
    nvtx = _NoNvtx

    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def current_stream(device=None):
        return _CPU_STREAM

    @staticmethod
    def default_stream(device=None):
        return _CPU_STREAM

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, device=None, **kwargs):
        return fn(*args, device=_cpu_if_cuda(device), **kwargs)

    return wrapper


class _CpuTorchView:
    """`torch`, except for `cuda` (see `_CpuCudaView`) and factories mapping CUDA devices to CPU."""

    def __init__(self):
        self.cuda = _CpuCudaView()
        for name in ("zeros", "empty", "ones", "full", "tensor"):
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)

    def __repr__(self):
        return "<torch with CUDA device calls redirected to CPU (megatron_dualpipe.cpu_compat)>"

"""The one stand-in for ``torch`` that CPU mode gives to Megatron's modules.

:data:`TORCH_VIEW` replaces the module-global name ``torch`` of the modules listed in
:mod:`.mcore` and :mod:`.megatron_lm`. It is the real ``torch`` except for:

* ``torch.cuda``: one virtual device that is the CPU. ``current_device()`` is
  ``torch.device("cpu")``; ``device_count()`` is 1 (Megatron-LM's initialization builds the
  model-parallel groups and seeds the RNG tracker only when it sees a device);
  ``set_device`` / ``synchronize`` / ``empty_cache`` / memory-statistics calls do nothing or
  return 0; ``Stream`` / ``Event`` / ``stream()`` / ``current_stream()`` / ``default_stream()``
  are inert (the CPU runs everything in order on one "stream", so every wait is already
  satisfied); ``nvtx`` ranges do nothing; the RNG-state calls use the CPU generator;
  ``get_device_properties()`` / ``get_device_capability()`` describe an architecture 0.0 device.
  ``is_available()`` stays False: the view is honest about the hardware.
* ``torch.device``: a CUDA device (``"cuda"``, ``"cuda:3"``, ``("cuda", 0)``) becomes the CPU;
  ``isinstance(x, torch.device)`` keeps working.
* the tensor factories (:data:`FACTORIES`): a CUDA ``device=`` (string, ``torch.device`` or an
  int ordinal) becomes the CPU.

Tensor and module *methods* cannot be reached through a module's ``torch`` name: for the
duration of one wrapped call, :func:`scoped_cuda_identity` makes ``tensor.cuda()`` and
``module.cuda()`` return their receiver, and :func:`scoped_cuda_type_names` makes
``tensor.type()`` name a CPU tensor's CUDA type (Megatron's optimizers sort parameters by it),
and :func:`scoped_record_stream_noop` makes ``tensor.record_stream()`` (which the CPU backend
lacks) do nothing for CPU tensors.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

__all__ = ["TORCH_VIEW", "TorchView", "cpu_if_cuda", "scoped_cuda_identity", "scoped_cuda_type_names",
           "scoped_record_stream_noop", "FACTORIES"]

CPU = torch.device("cpu")

#: torch functions whose ``device=`` keyword is mapped from CUDA to the CPU.
FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor",
)  # fmt: skip


def cpu_if_cuda(device):
    """``device`` with any CUDA device (a bare int is a CUDA ordinal) replaced by the CPU."""
    if isinstance(device, bool) or device is None:
        return device
    if isinstance(device, int):
        return CPU
    if isinstance(device, str):
        return CPU if device.split(":", 1)[0] == "cuda" else device
    if isinstance(device, torch.device):
        return CPU if device.type == "cuda" else device
    return device


class CpuEvent:
    """Inert ``torch.cuda.Event``: work on the CPU is complete when the call returns."""

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


class CpuStream:
    """Inert ``torch.cuda.Stream``: the CPU has one in-order stream."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


CPU_STREAM = CpuStream()

#: What ``torch.cuda.get_device_properties()`` says about the virtual device: architecture 0.0
#: (older than any GPU, so Megatron takes its pre-Hopper branches, e.g. the
#: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` check for tensor parallelism), no device memory.
CPU_PROPERTIES = types.SimpleNamespace(name="cpu (megatron_dualpipe CPU mode)", major=0, minor=0,
                                       total_memory=0, multi_processor_count=1)


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


class CpuCuda:
    """``torch.cuda`` for one virtual device that is the CPU; other names are the real ones."""

    Stream = CpuStream
    Event = CpuEvent
    nvtx = _NoNvtx()

    is_available = staticmethod(lambda: False)
    device_count = staticmethod(lambda: 1)
    current_device = staticmethod(lambda: CPU)
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
    current_stream = staticmethod(lambda device=None: CPU_STREAM)
    default_stream = staticmethod(lambda device=None: CPU_STREAM)
    stream = staticmethod(lambda s=None: contextlib.nullcontext())
    get_rng_state = staticmethod(lambda device=None: torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, device=None: torch.set_rng_state(state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))
    manual_seed_all = staticmethod(lambda seed: torch.manual_seed(seed))
    get_device_properties = staticmethod(lambda device=None: CPU_PROPERTIES)
    get_device_capability = staticmethod(lambda device=None: (CPU_PROPERTIES.major, CPU_PROPERTIES.minor))
    get_device_name = staticmethod(lambda device=None: CPU_PROPERTIES.name)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    def __repr__(self):
        return "<torch.cuda stand-in: one virtual device = the CPU (megatron_dualpipe.cpu)>"


class _DeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.device)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, torch.device)

    def __call__(cls, *args, **kwargs):
        dev = torch.device(*args, **kwargs)
        return CPU if dev.type == "cuda" else dev


class CpuDevice(metaclass=_DeviceMeta):
    """``torch.device`` that maps CUDA devices to the CPU."""


def _factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = cpu_if_cuda(kwargs["device"])
        return fn(*args, **kwargs)

    return factory


class TorchView:
    """The real ``torch`` except for ``cuda``, ``device`` and the factories in :data:`FACTORIES`."""

    def __init__(self):
        self.cuda = CpuCuda()
        self.device = CpuDevice
        for name in FACTORIES:
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)

    def __repr__(self):
        return "<torch with CUDA redirected to the CPU (megatron_dualpipe.cpu.torch_view)>"


def generator_state_for(seed: int) -> torch.Tensor:
    """The CPU default generator's state after ``manual_seed(seed)``, the generator left as it was:
    what the CPU mode's RNG trackers (Megatron's and Transformer Engine's stand-in) keep per named
    state, where a CUDA tracker keeps a CUDA generator's."""
    generator = torch.default_generator
    outer = generator.get_state()
    generator.manual_seed(seed)
    try:
        return generator.get_state()
    finally:
        generator.set_state(outer)


#: The single instance every redirected module sees as ``torch``.
TORCH_VIEW = TorchView()


def _grouped_gemm_capability(device=None):
    """8.0 while the CPU mode stands in for grouped_gemm (:mod:`.stand_ins.grouped_gemm` runs those
    kernels); else torch's own answer (without a GPU an error: a login node checking a GPU job's
    arguments leaves the question to the GPU nodes)."""
    from .stand_ins import active

    return (8, 0) if "grouped_gemm" in active() else torch.cuda.get_device_capability(device)


class _GroupedGemmCapableCuda(CpuCuda):
    """The CPU device, as able as the grouped GEMM kernels ask where the CPU mode runs them."""

    get_device_capability = staticmethod(_grouped_gemm_capability)


class GroupedGemmCapableView(TorchView):
    """:class:`TorchView` for Megatron-LM's argument check, which refuses ``--moe-grouped-gemm`` below
    compute capability 8 (its only question to the device): see :func:`_grouped_gemm_capability`."""

    def __init__(self):
        super().__init__()
        self.cuda = _GroupedGemmCapableCuda()


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _module_cuda(self, device=None):
    return self


_TENSOR_TYPE = torch.Tensor.type


def _tensor_type_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
    """``Tensor.type()``: a CPU tensor's type name as its CUDA counterpart's; conversions unchanged."""
    if dtype is not None or kwargs:
        return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)
    name = _TENSOR_TYPE(self)
    return "torch.cuda." + name[len("torch."):] if name.startswith("torch.") and not self.is_cuda else name


_INHERITED = object()  # the method was not in the class's own dict (it came from a base class)


@contextlib.contextmanager
def _torch_methods(owner_methods):
    """Set ``owner.name = method`` for each ``(owner, name, method)`` inside the block only."""
    saved = [(owner, name, vars(owner).get(name, _INHERITED)) for owner, name, _ in owner_methods]
    for owner, name, method in owner_methods:
        setattr(owner, name, method)
    try:
        yield
    finally:
        for owner, name, method in saved:
            if method is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, method)


def cuda_methods_are_identity():
    """``Tensor.cuda`` and ``nn.Module.cuda`` return their receiver inside the block only."""
    return _torch_methods([(torch.Tensor, "cuda", _tensor_cuda), (torch.nn.Module, "cuda", _module_cuda)])


def type_names_are_cuda():
    """``Tensor.type()`` names a CPU tensor's CUDA type ('torch.cuda.FloatTensor') inside the block."""
    return _torch_methods([(torch.Tensor, "type", _tensor_type_as_cuda)])


def _scoped(context, fn):
    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    return scoped


def scoped_cuda_identity(fn):
    """``fn`` run with :func:`cuda_methods_are_identity` (torch's globals restored afterwards)."""
    return _scoped(cuda_methods_are_identity, fn)


_RECORD_STREAM = torch.Tensor.record_stream


def _record_stream_unless_cpu(self, stream):
    if self.device.type != "cpu":
        _RECORD_STREAM(self, stream)


def record_stream_is_noop_on_cpu():
    """``Tensor.record_stream`` (which the CPU backend lacks) does nothing for CPU tensors inside the block."""
    return _torch_methods([(torch.Tensor, "record_stream", _record_stream_unless_cpu)])


def scoped_record_stream_noop(fn):
    """``fn`` run with :func:`record_stream_is_noop_on_cpu` (torch's globals restored afterwards)."""
    return _scoped(record_stream_is_noop_on_cpu, fn)


def scoped_cuda_type_names(fn):
    """``fn`` run with :func:`type_names_are_cuda` (torch's globals restored afterwards)."""
    return _scoped(type_names_are_cuda, fn)

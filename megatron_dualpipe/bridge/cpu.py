"""CPU redirections for Megatron-Bridge's training loop (``megatron.bridge.training.pretrain``).

With megatron-core's CPU mode (:mod:`megatron_dualpipe.cpu`) and these, Bridge's own ``pretrain()``
trains a tiny GPT on CPU with ``dist.distributed_backend="gloo"``: for the tests, as the Megatron-LM
list (``cpu/megatron_lm.py``) is for ``pretrain_gpt.py``. :data:`REDIRECTIONS` is the list, each with
its reason; :func:`enable` installs it (through the one patching mechanism, ``hooks.mechanism``)
after the CPU mode, :func:`disable` puts every attribute back.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import types
from typing import List

from ..cpu.redirection import Redirection, replace, torch_view, wrap
from ..cpu.torch_view import scoped_cuda_identity
from ..hooks.mechanism import PatchSet
from .version_gate import CORE_OF_BRIDGE_06

_TRAINING = "megatron.bridge.training"
_INIT = _TRAINING + ".initialize"


def _allow_no_cuda(initialize_megatron):
    return functools.partial(initialize_megatron, allow_no_cuda=True)


def _do_nothing(*args, **kwargs):
    return None


#: Modules whose global ``torch`` becomes the CPU view, with the CUDA sites on the pretrain path.
_VIEWS = (
    (_TRAINING + ".setup", "the start-time MIN all-reduce of a device='cuda' tensor"),
    (_INIT, "device_count() == 1 makes _set_random_seed seed megatron-core's RNG tracker; set_device; "
            "MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=current_device()))"),
    (_TRAINING + ".train", "empty_cache / synchronize, the exit-duration all-reduce"),
    (_TRAINING + ".eval", "loss accumulators and the exit-duration tensor on 'cuda'"),
    (_TRAINING + ".utils.train_utils", "params-norm and stat tensors on 'cuda', memory statistics"),
    ("megatron.bridge.models.model_provider", "the DDP-init side stream in _ddp_wrap, current_device()"),
    ("megatron.bridge.data.loaders", "the do_train/do_valid/do_test broadcast of a device='cuda' tensor"),
    (_TRAINING + ".checkpointing", "the torch.cuda RNG state in the checkpoint, the iteration all-reduce (save / load)"),
)  # fmt: skip

#: Every Bridge redirection, in the order it is applied (after megatron-core's CPU mode).
REDIRECTIONS = (
    wrap(_TRAINING + ".setup", "initialize_megatron", _allow_no_cuda,
         "asserts torch.cuda.is_available() ('Megatron requires CUDA.') unless allow_no_cuda=True, which setup() "
         "does not pass (setup imports it by name)"),
    *(torch_view(module, why) for module, why in _VIEWS),
    Redirection(_INIT, "compile_helpers", "megatron_dualpipe.megatron_lm.dataset_helpers:replace_compile_helpers",
            "initialize_megatron builds megatron-core's dataset helper through make with the python3 on PATH and the "
            "Makefile a megatron-core wheel lacks; megatron_lm.dataset_helpers builds it for the running interpreter "
            "and keeps a library that is up to date"),
    torch_view("megatron.training.models.dist_utils", "Bridge 0.6's _ddp_wrap is megatron-core 0.19's: the DDP-init "
               "side stream, current_device()", CORE_OF_BRIDGE_06),
    replace(_INIT, "_warmup_jit_function", _do_nothing,
            "allocates its warm-up inputs with device='cuda' to pre-compile fused kernels the CPU runs unfused"),
    wrap("megatron.bridge.models.model_provider", "get_model", scoped_cuda_identity,
         "model_module.cuda(current_device()): Tensor.cuda / Module.cuda are the identity during this call only"),
    wrap(_TRAINING + ".gpt_step", "get_batch_from_iterator", scoped_cuda_identity,
         "val.cuda(non_blocking=True) on the batch (identity during this call only)"),
    wrap(_TRAINING + ".eval", "evaluate", scoped_cuda_identity,
         "torch.tensor(...).cuda() loss accumulators (identity during this call only)"),
)  # fmt: skip

_SETS: List[PatchSet] = []


def enable() -> bool:
    """The CPU mode (megatron-core's, Bridge imported, then Bridge's list); False where CUDA is available."""
    from .. import cpu

    if not cpu.enable():
        return False
    _transformer_engine_or_raise()
    import_bridge()
    if not _SETS:
        patches = PatchSet("cpu megatron-bridge", REDIRECTIONS)
        patches.install()
        _SETS.append(patches)
    return True


def _transformer_engine_or_raise() -> None:
    """Bridge imports Transformer Engine unconditionally (its LoRA layers): without the library, the CPU
    mode's stand-in must be in place, and it is not installed once megatron-core has read TE's absence."""
    from ..cpu import stand_ins

    if "transformer_engine" not in stand_ins.active() and not stand_ins.real_library("transformer_engine"):
        raise RuntimeError("megatron_dualpipe.bridge.cpu.enable() came after megatron-core was imported without "
                           "Transformer Engine, which Bridge imports: call it before anything imports megatron")


def import_bridge() -> None:
    """Import Bridge's training modules. ``import megatron.bridge`` imports megatron-core's Mamba mixer,
    whose triton kernels are decorated at import: without triton (a CPU-only torch), under the package's
    placeholder (``megatron_lm.triton_stub``), which fails only if a kernel is launched. Bridge 0.6's
    ``training/pretrain.py`` imports nvidia-resiliency-ext's ``CallWrapper`` unconditionally: without
    that package, under :func:`placeholder_resiliency`."""
    import importlib

    from ..megatron_lm.triton_stub import placeholder_triton

    importlib.import_module("torch._dynamo")  # torch's compiler stack probes triton: it must see the truth
    importlib.import_module("megatron.core")  # it must see the truth about nvidia-resiliency-ext too
    with placeholder_triton(), placeholder_resiliency():
        for name in ("megatron.bridge", "megatron.bridge.training.pretrain"):
            importlib.import_module(name)


_NVRX = "nvidia_resiliency_ext"


class _NoInProcessRestart:
    """Bridge's type of the in-process restart wrapper, where nvidia-resiliency-ext is not installed."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("in-process restart needs nvidia-resiliency-ext (megatron-core 0.19 asks for >= 0.6.0)")


@contextlib.contextmanager
def placeholder_resiliency():
    """While Bridge is imported, where nvidia-resiliency-ext is not installed: ``nvidia_resiliency_ext.inprocess``
    holding only ``CallWrapper`` (Bridge 0.6's ``pretrain.py`` imports it for a type; in-process restart is
    refused, ``bridge.checks``). The package cannot simply be installed: megatron-core 0.19 asserts >= 0.6.0
    at import once its async-checkpoint modules import, and the newest on PyPI here is 0.4.1. Its other
    users in Bridge import it inside ``try`` and see it missing (the placeholder has no other submodule)."""
    if importlib.util.find_spec(_NVRX) is not None:
        yield False
        return
    from ..megatron_lm.triton_stub import modules_placed

    root, inprocess = types.ModuleType(_NVRX), types.ModuleType(_NVRX + ".inprocess")
    root.__path__, root.inprocess, inprocess.CallWrapper = [], inprocess, _NoInProcessRestart
    with modules_placed({_NVRX: root, _NVRX + ".inprocess": inprocess}):
        yield True


def disable() -> None:
    """Undo :func:`enable` (Bridge's list, then the CPU mode)."""
    from .. import cpu

    while _SETS:
        _SETS.pop().uninstall()
    cpu.disable()

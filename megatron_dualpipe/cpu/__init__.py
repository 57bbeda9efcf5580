"""CPU mode: run megatron-core and Megatron-LM's training loop on a machine without a GPU.

Megatron assumes CUDA in many places (``device="cuda"`` tensors, ``torch.cuda`` streams and RNG,
``tensor.cuda()``, CUDA type checks). CPU mode redirects each of those places, and nothing else,
so that the tests, the CPU demo and ``pretrain_gpt.py`` with gloo run on a CPU-only machine.

* One list of redirections, each a module attribute, its replacement and the reason:
  :data:`.mcore.REDIRECTIONS` (megatron-core) and :data:`.megatron_lm.REDIRECTIONS` (Megatron-LM's
  training code). ``megatron-dualpipe cpu-mode`` prints them and whether each is active.
* One stand-in for ``torch`` (:mod:`.torch_view`), given to the modules that need it.
* :func:`enable` applies them only when ``torch.cuda.is_available()`` is False: product code may
  call it unconditionally, and CPU mode is never active next to a GPU (forcing it there is an
  error). It is idempotent; ``enable(megatron_lm=True)`` adds the Megatron-LM list.
* :func:`disable` puts back every replaced attribute, the very object that was there.

torch itself is touched only inside the calls wrapped by :func:`.torch_view.scoped_cuda_identity`
(``Tensor.cuda`` / ``Module.cuda``, restored when the call returns).

This module imports only the standard library; torch and Megatron are imported on :func:`enable`.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Tuple

from ..hooks.mechanism import PatchSet
from .redirection import Redirection

__all__ = ["enable", "disable", "active", "parts", "redirections", "status", "Redirection", "PARTS"]

#: The parts of CPU mode, in the order they are applied: name -> module holding its list.
PARTS = {"megatron-core": "megatron_dualpipe.cpu.mcore",
         "megatron-lm": "megatron_dualpipe.cpu.megatron_lm"}

_SETS: Dict[str, PatchSet] = {}  # part -> its installed set, in the order applied


def redirections(part: str) -> Tuple[Redirection, ...]:
    """The redirections of one part (see :data:`PARTS`)."""
    import importlib

    return importlib.import_module(PARTS[part]).REDIRECTIONS


def enable(*, megatron_lm: bool = False, force: bool = False) -> bool:
    """Switch CPU mode on (megatron-core; with ``megatron_lm`` also Megatron-LM's training code).

    Returns False and changes nothing when CUDA is available, True when CPU mode is active.
    ``force=True`` says the caller requires CPU mode: with CUDA available that raises instead.
    Redirections written for other megatron-core versions are skipped (``status`` says so).
    """
    import torch

    if torch.cuda.is_available():
        if force:
            raise RuntimeError(
                "megatron_dualpipe CPU mode was forced on a machine where CUDA is available. It "
                "redirects Megatron's CUDA calls to the CPU and is never switched on next to a GPU: "
                "drop the request (e.g. megatron_lm.install.install(cpu=True) -> install())."
            )
        return False
    _stand_in_for_gpu_libraries()
    wanted = ["megatron-core"] + (["megatron-lm"] if megatron_lm else [])
    for part in wanted:
        if part not in _SETS:
            patches = PatchSet(f"cpu {part}", redirections(part))
            patches.install()
            _SETS[part] = patches
    return True


def disable() -> None:
    """Undo :func:`enable`: every replaced attribute gets back the object that was there.

    Warns (and still restores) when someone else replaced one of our replacements meanwhile.
    """
    overwritten = []
    for part in reversed(list(_SETS)):
        overwritten += _SETS.pop(part).uninstall()
    _no_stand_ins()
    if overwritten:
        warnings.warn("megatron_dualpipe CPU mode: restored attributes that had been replaced "
                      "again after CPU mode patched them: " + ", ".join(overwritten), stacklevel=2)


_EAGER: list = []  # [True] while enable() holds torch.compile eager
#: megatron-core modules that decide at import whether the GPU libraries exist: once one of them is
#: imported without the stand-ins, installing them would leave megatron half with and half without
#: (attention's HAVE_TE true, the TE extension's classes None).
_READ_AT_IMPORT = ("megatron.core.extensions.transformer_engine", "megatron.core.tensor_parallel.layers",
                   "megatron.core.transformer.attention", "megatron.core.transformer.moe.fused_a2a",
                   "megatron.core.transformer.moe.grouped_gemm_util")


def _stand_in_for_gpu_libraries() -> None:
    """The GPU users' libraries that are not installed (Transformer Engine, grouped_gemm, DeepEP,
    apex's wgrad GEMM) as the CPU mode's stand-ins (:mod:`.stand_ins`). Megatron reads whether they
    exist when its modules are imported: a process that means to use them must get here (or call
    ``stand_ins.install()``) before it imports megatron-core, as the launcher does
    (``megatron_lm.install``); once megatron-core has read their absence, none is installed
    (``stand_ins.megatron_rebind`` re-reads the MoE ones for a caller that installs them itself). torch.compile runs eagerly: Megatron's ``jit_fuser``
    functions (the flex dispatcher's, the experts' activations) would compile C++ for every rank of
    a CPU run, for the same numbers."""
    import sys

    import torch

    from . import stand_ins

    if not any(reader in sys.modules for reader in _READ_AT_IMPORT):  # else: a world without them, consistently
        stand_ins.install()
    if not _EAGER:
        torch.compiler.set_stance("force_eager")
        _EAGER.append(True)


def _no_stand_ins() -> None:
    from . import stand_ins

    stand_ins.uninstall()
    if _EAGER:
        import torch

        _EAGER.pop()
        torch.compiler.set_stance("default")


def active() -> bool:
    """True while CPU mode is on in this process."""
    return bool(_SETS)


def parts() -> Tuple[str, ...]:
    """The parts that are on, in the order they were applied."""
    return tuple(_SETS)


def status() -> List[Tuple[str, Redirection, str]]:
    """(part, redirection, state) for every redirection; state is one of ``active``,
    ``inactive``, ``not needed`` (an only-if-missing target that exists), ``not for
    megatron-core X`` (written for other versions) or ``replaced by someone else``."""
    rows = []
    for part in PARTS:
        patches = _SETS.get(part) or PatchSet(f"cpu {part}", redirections(part))
        rows += [(part, r, state) for r, state in patches.status()]
    return rows

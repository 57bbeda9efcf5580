"""Make megatron-core see the stand-ins when its MoE modules were imported before they were installed.

megatron-core decides whether grouped_gemm and DeepEP exist once, at import:
``grouped_gemm_util`` binds ``grouped_gemm`` / ``ops``, ``fused_a2a`` sets ``HAVE_DEEP_EP`` and
defines ``fused_dispatch`` / ``fused_combine`` / ``set_deepep_num_sms`` only then, and
``token_dispatcher`` copies those names. A process that imported them first (a forkserver that
preloads megatron-core, as the test harness does) keeps the "not installed" answer after
:func:`~megatron_dualpipe.cpu.stand_ins.install`. :func:`rebind` re-runs those two modules in place
(the same module objects, so ``experts.gg`` follows) and points every megatron-core module that
had copied a name from them at the new value. After :func:`~megatron_dualpipe.cpu.stand_ins.uninstall`
it gives megatron-core back the "not installed" answer the same way.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Dict, List

#: Library -> the megatron-core modules that read its presence at import.
READERS: Dict[str, str] = {
    "grouped_gemm": "megatron.core.transformer.moe.grouped_gemm_util",
    "deep_ep": "megatron.core.transformer.moe.fused_a2a",
}


#: Where the names the readers define are copied (``token_dispatcher``); nothing else imports them.
IMPORTERS = "megatron.core.transformer.moe."


def _copies_of(module: types.ModuleType, old: dict) -> List[tuple]:
    """(importer, name) for every module under :data:`IMPORTERS` holding one of ``old``'s values under its name."""
    found = []
    for importer_name, importer in list(sys.modules.items()):
        if importer is module or importer is None or not importer_name.startswith(IMPORTERS):
            continue
        for name, value in vars(importer).items():
            if name in old and not isinstance(value, types.ModuleType) and value is old[name]:
                found.append((importer, name))
    return found


def rebind(libraries=tuple(READERS)) -> List[str]:
    """Re-import the readers of ``libraries`` that are already imported; returns the readers re-run
    and the copied names that changed (``module.name``)."""
    rebound = []
    for library in libraries:
        module = sys.modules.get(READERS[library])
        if module is None:
            continue  # imported later, it reads the stand-in (or its absence) itself
        old = {k: v for k, v in vars(module).items() if not k.startswith("__")}
        copies = _copies_of(module, old)
        importlib.reload(module)
        rebound.append(module.__name__)
        for importer, name in copies:
            if hasattr(module, name) and getattr(module, name) is not old[name]:
                setattr(importer, name, getattr(module, name))
                rebound.append(f"{importer.__name__}.{name}")
    return rebound

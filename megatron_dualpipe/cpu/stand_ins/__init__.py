"""Stand-ins for the CUDA-only libraries on the GPU users' path: Transformer Engine, grouped_gemm, DeepEP.

Every GPU user of Megatron-LM runs Transformer Engine layers (``--transformer-impl
transformer_engine``, the default), and DeepSeek-V3-class runs add grouped GEMM and DeepEP. None of
them installs without CUDA, so on this machine megatron-core would take its local path and the
plugin's code for the TE path would never run. A stand-in is a package of our own that keeps the
library's contract as its source shows it (the calls megatron-core makes, their numerics on CPU
and what they defer or accumulate where), importable under the library's own name while the CPU
mode is on.

:func:`install` puts a finder on ``sys.meta_path`` that answers ``import transformer_engine`` (and
its submodules) with ``megatron_dualpipe.cpu.stand_ins.transformer_engine`` (the same module object
under both names). It installs nothing where the real library can be imported (:func:`real_library`),
and only the CPU mode calls it, so a stand-in never shadows a real installation and never loads
outside the CPU mode. :func:`uninstall` removes the finder and every module it handed out.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Dict, List, Optional

#: The library's import name -> the package of its stand-in.
STAND_INS: Dict[str, str] = {
    "transformer_engine": f"{__name__}.transformer_engine",
    "grouped_gemm": f"{__name__}.grouped_gemm",
    "deep_ep": f"{__name__}.deep_ep",
    "fused_weight_gradient_mlp_cuda": f"{__name__}.fused_weight_gradient_mlp_cuda",
}


class _Alias(importlib.abc.Loader):
    """Hands out our module under the library's name: one object, two names in ``sys.modules``."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):  # already executed under its own name
        pass


class StandInFinder(importlib.abc.MetaPathFinder):
    """Finds ``NAME`` and ``NAME.sub`` for each library name it was given, as its stand-in."""

    def __init__(self, names):
        self.names = tuple(names)

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top not in self.names:
            return None
        if fullname == top:
            if importlib.machinery.PathFinder.find_spec(top) is not None:
                return None  # installed since install(): the real library wins
        elif getattr(sys.modules.get(top), "__name__", None) != STAND_INS[top]:
            return None  # the package imported under that name is not ours: its submodules neither
        ours = STAND_INS[top] + fullname[len(top):]
        found = importlib.util.find_spec(ours)
        if found is None:
            return None  # a submodule the stand-in does not have: the import fails as without the library
        return importlib.machinery.ModuleSpec(fullname, _Alias(ours), is_package=found.submodule_search_locations
                                              is not None)


_FINDER: Optional[StandInFinder] = None


def real_library(name: str) -> bool:
    """True when ``name`` can be imported without the stand-ins (a real installation)."""
    if _FINDER is not None and name in _FINDER.names:
        return False  # the finder answers only for libraries that were absent when it was installed
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install(names=tuple(STAND_INS)) -> List[str]:
    """Stand in for each library of ``names`` that is not installed; returns those stood in for."""
    global _FINDER
    missing = [n for n in names if n in STAND_INS and not real_library(n)]
    if _FINDER is not None:
        missing = sorted(set(missing) | set(_FINDER.names))
        sys.meta_path.remove(_FINDER)
    _FINDER = StandInFinder(missing) if missing else None
    if _FINDER is not None:
        # First: after them, the path finders would find ``NAME.sub`` again through the stand-in
        # package's own ``__path__`` and execute it a second time under the library's name (two
        # copies of every class). A library installed later still wins (see find_spec).
        sys.meta_path.insert(0, _FINDER)
    return list(missing)


def uninstall() -> None:
    """Remove the finder and every module it handed out under a library's name."""
    global _FINDER
    if _FINDER is None:
        return
    sys.meta_path.remove(_FINDER)
    for name in list(sys.modules):
        if name.partition(".")[0] in _FINDER.names:
            del sys.modules[name]
    _FINDER = None


def active() -> List[str]:
    """The libraries stood in for now."""
    return list(_FINDER.names) if _FINDER is not None else []

"""A placeholder ``triton`` package, only while the Megatron modules that decorate kernels with
``@triton.jit`` at import time import; calling it raises ``RuntimeError`` naming the package (the
kernels run only with ``--batch-invariant-mode``, which needs a GPU anyway)."""

import contextlib
import importlib
import importlib.util
import sys
import types

_MESSAGE = (
    "triton is not installed; megatron_dualpipe registered a placeholder 'triton' module so "
    "that Megatron-LM can be imported. '{what}' needs the real package: pip install triton "
    "(and a GPU)."
)


class _Placeholder:
    """Stands in for any triton object: survives import-time use, fails when really used."""

    def __init__(self, name):
        self._name = name

    def __repr__(self):
        return f"<triton placeholder {self._name}>"

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __getitem__(self, item):  # kernel[grid](...)
        raise RuntimeError(_MESSAGE.format(what=f"{self._name}[...]"))

    def __call__(self, *args, **kwargs):
        raise RuntimeError(_MESSAGE.format(what=f"{self._name}(...)"))


def _decorator_factory(name):
    """``@triton.jit``, ``@triton.jit(...)``, ``@triton.autotune(...)``, ``@triton.heuristics(...)``."""

    def deco(fn=None, **kwargs):
        if callable(fn) and not kwargs:
            return _Placeholder(f"{name}({getattr(fn, '__name__', 'fn')})")
        return lambda f: _Placeholder(f"{name}({getattr(f, '__name__', 'fn')})")

    return deco


class _StubModule(types.ModuleType):
    __getattr__ = _Placeholder.__getattr__  # its attributes are placeholders too, named after it


def _make_module(name):
    mod = _StubModule(name)
    mod._name = name
    mod.__file__ = __file__
    mod.__path__ = []  # behave like a package so submodule imports resolve via sys.modules
    mod.__megatron_dualpipe_stub__ = True
    return mod


def triton_available() -> bool:
    if "triton" in sys.modules:
        return not getattr(sys.modules["triton"], "__megatron_dualpipe_stub__", False)
    return importlib.util.find_spec("triton") is not None


def _stub_modules():
    root = _make_module("triton")
    root.__version__ = "0.0.0+megatron_dualpipe.stub"
    for deco in ("jit", "autotune", "heuristics"):
        setattr(root, deco, _decorator_factory(f"triton.{deco}"))
    root.Config = lambda *a, **k: _Placeholder("triton.Config()")
    mods = {"triton": root}
    for sub in ("language", "language.extra", "language.extra.libdevice", "runtime", "tools"):
        mod = _make_module(f"triton.{sub}")
        mods[f"triton.{sub}"] = mod
        parent_name, _, leaf = f"triton.{sub}".rpartition(".")
        setattr(mods[parent_name], leaf, mod)
    return mods


@contextlib.contextmanager
def placeholder_triton():
    """While active, ``import triton`` yields the stub (only if no real triton exists). Removed on
    exit: code imported later (torch's ``has_triton_package()``) must still see triton missing."""
    if triton_available():
        yield False
        return
    with modules_placed(_stub_modules()):
        yield True


@contextlib.contextmanager
def modules_placed(mods):
    """``sys.modules`` holds ``mods`` (name -> module) within the block; on exit each is removed
    unless something replaced it meanwhile (also Bridge's placeholder, ``bridge.cpu``)."""
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name, mod in mods.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]


# Megatron modules on ``pretrain_gpt.py``'s import path that import triton unconditionally.
TRITON_IMPORTERS = ("megatron.core.transformer.custom_layers.batch_invariant_kernels",)


def preimport_triton_users() -> bool:
    """Import :data:`TRITON_IMPORTERS` under :func:`placeholder_triton`. True if the stub was used."""
    # torch._dynamo / _inductor probe ``import triton``: imported first, without the stub.
    importlib.import_module("torch._dynamo")
    importlib.import_module("megatron.core")
    with placeholder_triton() as used:
        for name in TRITON_IMPORTERS:
            importlib.import_module(name)
    return used

"""What one CPU redirection is, and how it is applied and undone.

A :class:`Redirection` names a module attribute (``module`` + ``attribute``, which may be a
class attribute such as ``"GlobalMemoryBuffer.get_tensor"``), says how to build its replacement
from the original object, and says why Megatron needs it on a CPU. :func:`apply` records the
exact object it replaced (or that there was none) so that :func:`restore` puts that same object
back. This module needs only the standard library: the lists that hold the redirections import
torch, the CLI that prints them need not.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Tuple

__all__ = ["Redirection", "Applied", "MISSING", "torch_view", "wrap", "replace", "define_if_missing",
           "resolve", "apply", "restore", "current"]


class _Missing:
    def __repr__(self):
        return "<missing>"


#: Stands for "the attribute did not exist" (restoring it deletes the attribute).
MISSING = _Missing()


@dataclass(frozen=True)
class Redirection:
    """``module.attribute`` is replaced by ``make(original)`` while CPU mode is on.

    ``make`` receives the original object (:data:`MISSING` if there is none). With
    ``only_if_missing`` the redirection is applied only when the attribute does not exist.
    """

    module: str
    attribute: str
    make: Callable[[Any], Any]
    why: str
    only_if_missing: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"


def torch_view(module: str, why: str) -> Redirection:
    """The module-global name ``torch`` of ``module`` becomes :data:`.torch_view.TORCH_VIEW`."""

    def view(original):
        from .torch_view import TORCH_VIEW

        return TORCH_VIEW

    return Redirection(module, "torch", view, why)


def wrap(module: str, attribute: str, wrapper: Callable[[Any], Any], why: str) -> Redirection:
    """``module.attribute`` becomes ``wrapper(original)``."""
    return Redirection(module, attribute, wrapper, why)


def replace(module: str, attribute: str, value: Any, why: str) -> Redirection:
    """``module.attribute`` becomes ``value`` (the original is not used)."""
    return Redirection(module, attribute, lambda original: value, why)


def define_if_missing(module: str, attribute: str, value: Any, why: str) -> Redirection:
    """``module.attribute = value`` only when ``module`` does not define it."""
    return Redirection(module, attribute, lambda original: value, why, only_if_missing=True)


@dataclass(frozen=True)
class Applied:
    """One applied redirection: where it went, what was there, what was put there."""

    redirection: Redirection
    owner: Any
    name: str
    saved: Any  # the owner's own attribute before (MISSING if it had none)
    replacement: Any


def resolve(redirection: Redirection) -> Tuple[Any, str]:
    """The object that holds the attribute (module or class) and the attribute's name."""
    owner = importlib.import_module(redirection.module)
    *path, name = redirection.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def current(owner: Any, name: str) -> Any:
    """The owner's *own* attribute (not an inherited one), or :data:`MISSING`."""
    return vars(owner).get(name, MISSING)


def apply(redirection: Redirection):
    """Apply one redirection; returns :class:`Applied`, or None when it is not needed here."""
    owner, name = resolve(redirection)
    saved = current(owner, name)
    if redirection.only_if_missing and saved is not MISSING:
        return None
    replacement = redirection.make(getattr(owner, name, MISSING))
    setattr(owner, name, replacement)
    return Applied(redirection, owner, name, saved, replacement)


def restore(applied: Applied) -> bool:
    """Put the saved object back (delete the attribute if there was none).

    Returns False when someone replaced our replacement in the meantime (it is restored anyway).
    """
    ours = current(applied.owner, applied.name) is applied.replacement
    if applied.saved is MISSING:
        if current(applied.owner, applied.name) is not MISSING:
            delattr(applied.owner, applied.name)
    else:
        setattr(applied.owner, applied.name, applied.saved)
    return ours

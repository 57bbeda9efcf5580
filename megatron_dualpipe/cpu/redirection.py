"""The CPU mode's redirections: patches of Megatron (:mod:`megatron_dualpipe.hooks.mechanism`).

A redirection is a :class:`~megatron_dualpipe.hooks.mechanism.Patch` (module attribute, how to
build its replacement from the original, why Megatron needs it on a CPU, the megatron-core
versions it applies to), installed as a set by :func:`megatron_dualpipe.cpu.enable` and undone
by :func:`~megatron_dualpipe.cpu.disable`. This module adds the constructors the CPU lists are
written with. Standard library only: the lists that hold the redirections import torch, the CLI
that prints them need not.
"""

from __future__ import annotations

from typing import Any, Callable

from ..hooks.mechanism import (ALL_VERSIONS, MISSING, Applied, Patch, Versions, apply, current, resolve,
                               restore)

__all__ = ["Redirection", "Applied", "MISSING", "Versions", "torch_view", "wrap", "replace", "define_if_missing",
           "resolve", "apply", "restore", "current"]

#: One CPU redirection (the same thing as any other patch of Megatron).
Redirection = Patch


def torch_view(module: str, why: str, versions: Versions = ALL_VERSIONS) -> Redirection:
    """The module-global name ``torch`` of ``module`` becomes :data:`.torch_view.TORCH_VIEW`."""
    return Redirection(module, "torch", _torch_view, why, versions)


def _torch_view(original):
    from .torch_view import TORCH_VIEW

    return TORCH_VIEW


def wrap(module: str, attribute: str, wrapper: Callable[[Any], Any], why: str,
         versions: Versions = ALL_VERSIONS) -> Redirection:
    """``module.attribute`` becomes ``wrapper(original)``."""
    return Redirection(module, attribute, wrapper, why, versions)


def replace(module: str, attribute: str, value: Any, why: str, versions: Versions = ALL_VERSIONS) -> Redirection:
    """``module.attribute`` becomes ``value`` (the original is not used)."""
    return Redirection(module, attribute, lambda original: value, why, versions)


def define_if_missing(module: str, attribute: str, value: Any, why: str,
                      versions: Versions = ALL_VERSIONS) -> Redirection:
    """``module.attribute = value`` only when ``module`` does not define it."""
    return Redirection(module, attribute, lambda original: value, why, versions, only_if_missing=True)

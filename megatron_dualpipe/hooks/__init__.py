"""The one mechanism by which megatron-dualpipe changes Megatron (:mod:`.mechanism`), the list of
every change (:mod:`.manifest`), and install / uninstall / status of its parts (``megatron-dualpipe hooks``)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from . import manifest
from .mechanism import INSTALLED, SCOPED, Patch, PatchSet, active_scoped, megatron_core_version, scoped

__all__ = ["install", "uninstall", "installed", "status", "scoped", "entry", "Patch", "PARTS"]

PARTS = manifest.PARTS
entry = manifest.entry

_SETS: Dict[str, PatchSet] = {}  # installed part -> its set


def install(parts: Sequence[str], version: Optional[str] = None) -> List[str]:
    """Install the given parts of the manifest (in the given order; idempotent per part).
    Returns the parts installed now."""
    done = []
    for part in parts:
        if part not in manifest.INSTALLED_PARTS:
            raise ValueError(f"{part!r} is not an installed part of the manifest: one of {manifest.INSTALLED_PARTS}")
        if part not in _SETS:
            patches = PatchSet(part, PARTS[part])
            patches.install(version)
            _SETS[part] = patches
            done.append(part)
    return done


def uninstall(parts: Optional[Sequence[str]] = None) -> List[str]:
    """Undo :func:`install` of ``parts`` (default: all), newest first; every patched attribute
    gets back the very object it had. Returns the targets someone else had replaced again."""
    overwritten: List[str] = []
    for part in reversed(list(_SETS)):
        if parts is None or part in parts:
            overwritten += _SETS.pop(part).uninstall()
    return overwritten


def installed() -> Tuple[str, ...]:
    """The installed parts, in order."""
    return tuple(_SETS)


def status() -> List[Tuple[str, Patch, str]]:
    """(part, patch, state) for every entry of the manifest (``megatron-dualpipe hooks`` prints them)."""
    now, version = active_scoped(), megatron_core_version()
    rows = []
    for part, patches in PARTS.items():
        for p in patches:
            if part in _SETS:
                state = _SETS[part].state(p)
            elif version not in p.versions:
                state = f"not for megatron-core {version} (applies to {p.versions})"
            elif p.kind == SCOPED:
                state = f"scoped, active now ({now[p.target]})" if now.get(p.target) else "scoped"
            else:
                state = "inactive" if p.kind == INSTALLED else "per object"
            rows.append((part, p, state))
    return rows

"""Which Megatron-Bridge the adapter may patch: it replaces names inside Bridge's own modules (read
from 0.3.1's source), which another release may have moved or changed."""
from __future__ import annotations

from typing import Optional

from .. import versions

#: The Bridge release series the adapter knows (major, minor), and the release it was tested with.
SERIES = ((0, 3),)
TESTED = "0.3.1"
REQUIREMENT = "megatron-bridge>=0.3.1,<0.4"


def installed_bridge_version() -> Optional[str]:
    """The installed Megatron-Bridge's version (package metadata, no import), or None."""
    from importlib import metadata

    try:
        return metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        return None


def problem(version: Optional[str]) -> Optional[str]:
    """One line saying what to install when ``version`` is not a known Bridge, else None
    (None too under ``MEGATRON_DUALPIPE_SKIP_VERSION_CHECK=1``)."""
    if versions.skipped() or (version is not None and versions.parse(version)[:2] in SERIES):
        return None
    found = f"megatron-bridge {version}" if version else "no megatron-bridge"
    return (f"found {found}; megatron_dualpipe.bridge patches Megatron-Bridge 0.3.x (tested: {TESTED}): "
            f"pip install '{REQUIREMENT}' --no-deps, or set {versions.SKIP_ENV}=1 to try anyway")


def problems() -> list:
    """The Bridge and megatron-core versions installed here, as one line each (empty: supported)."""
    found = [problem(installed_bridge_version()), versions.problem(versions.installed_core_version())]
    return [p for p in found if p]

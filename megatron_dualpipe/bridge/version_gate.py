"""Which Megatron-Bridge the adapter may patch: it replaces names inside Bridge's own modules (read
from 0.3.1's and 0.6.2's source), which another release may have moved or changed. Each Bridge series
runs on one megatron-core series (0.6 imports ``megatron.training`` from megatron-core 0.19's wheel), and
the patches that differ between the two name that megatron-core series (``bridge.patches``, ``bridge.cpu``)."""
from __future__ import annotations

from typing import Optional

from .. import versions
from ..hooks.mechanism import Versions

#: Bridge 0.6 moved its DDP wrapping into megatron-core 0.19's ``megatron.training`` and its checkpoint
#: calls behind a ``CheckpointManager``: the patches for one or the other carry these.
CORE_OF_BRIDGE_03, CORE_OF_BRIDGE_06 = Versions(below="0.19"), Versions("0.19")

#: The Bridge series the adapter knows (major, minor) -> (the release tested, the megatron-core it runs on,
#: the pip requirement).
SERIES = {
    (0, 3): ("0.3.1", CORE_OF_BRIDGE_03, "megatron-bridge>=0.3.1,<0.4"),
    (0, 6): ("0.6.2", CORE_OF_BRIDGE_06, "megatron-bridge>=0.6,<0.7"),
}


def installed_bridge_version() -> Optional[str]:
    """The installed Megatron-Bridge's version (package metadata, no import), or None."""
    from importlib import metadata

    try:
        return metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        return None


def problem(version: Optional[str], core: Optional[str] = None) -> Optional[str]:
    """One line saying what to install when ``version`` is not a known Bridge, or runs on another
    megatron-core (``core``) than its series, else None (None too under ``MEGATRON_DUALPIPE_SKIP_VERSION_CHECK=1``)."""
    if versions.skipped():
        return None
    series = SERIES.get(versions.parse(version)[:2]) if version is not None else None
    if series is not None:
        tested, core_series, _ = series
        if core is None or core in core_series:
            return None
        return (f"megatron-bridge {version} runs on megatron-core {core_series} (tested: Bridge {tested}), found "
                f"megatron-core {core}: install the pair of docs/megatron-bridge.md, or set {versions.SKIP_ENV}=1")
    found = f"megatron-bridge {version}" if version else "no megatron-bridge"
    known = " or ".join(f"'{req}' (tested: {tested})" for tested, _, req in SERIES.values())
    return (f"found {found}; megatron_dualpipe.bridge patches Megatron-Bridge 0.3.x or 0.6.x: pip install {known} "
            f"--no-deps, or set {versions.SKIP_ENV}=1 to try anyway")


def problems() -> list:
    """The Bridge and megatron-core versions installed here, as one line each (empty: supported)."""
    core = versions.installed_core_version()
    found = [problem(installed_bridge_version(), core), versions.problem(core)]
    return [p for p in found if p]

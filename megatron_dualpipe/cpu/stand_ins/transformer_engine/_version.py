"""The Transformer Engine release whose contract the stand-in keeps, chosen by the megatron-core next to it.

megatron-core branches on ``is_te_min_version`` (argument names, which features exist), and the plugin
supports TE ``>=2.9,<2.12`` with megatron-core 0.16.1 and TE ``2.17.*`` with megatron-core 0.19.x
(docs/versions.md). The stand-in claims the newest release of the range that goes with the installed
megatron-core, read from its ``package_info.py`` without importing megatron (the stand-in is imported
while ``megatron.core`` itself is still being imported).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import Optional, Tuple

#: megatron-core (major, minor) from which on a claim holds -> the TE version claimed.
CLAIMS = (((0, 19), "2.17.0"), ((0, 0), "2.11.0"))


def megatron_core_version() -> Optional[Tuple[int, int]]:
    """(major, minor) of the megatron-core that ``import megatron`` would load, None without one."""
    loaded = sys.modules.get("megatron.core.package_info")
    if loaded is not None:
        return int(loaded.MAJOR), int(loaded.MINOR)
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "core", "package_info.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            major, minor = (re.search(rf"^{name}\s*=\s*(\d+)", text, re.M) for name in ("MAJOR", "MINOR"))
            if major and minor:
                return int(major.group(1)), int(minor.group(1))
    return None


def claimed_version() -> str:
    """The TE version string the stand-in reports as ``transformer_engine.__version__``."""
    core = megatron_core_version() or (0, 0)
    return next(te for since, te in CLAIMS if core >= since)


def version_tuple() -> Tuple[int, int]:
    """(major, minor) of :func:`claimed_version`, for the few behaviours that differ by release."""
    major, minor = claimed_version().split(".")[:2]
    return int(major), int(minor)

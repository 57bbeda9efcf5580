"""Which Megatron versions megatron-dualpipe supports: the one place that says so (``setup.py``, the
imports' and the launcher's refusals, ``patch``). What differs *between* them is where it is used,
each entry naming its versions. Standard library only, no relative imports: ``setup.py`` runs this
file on its own.
"""
from __future__ import annotations

import os
import re
from typing import Optional, Tuple

#: Megatron-LM tags the plugin is tested with -> the megatron-core version a checkout's ``package_info.py`` says.
TAGS = {"core_v0.16.1": "0.16.1", "core_v0.19.0": "0.19.1"}
#: The supported megatron-core release series -> its lowest supported release (0.17 and 0.18 were
#: never run, and no Megatron-LM tag of theirs has hooks written for it).
SERIES = {(0, 16): (0, 16, 1), (0, 19): (0, 19, 0)}
#: pip's form of :data:`SERIES` (setup.py).
REQUIREMENT = "megatron-core>=0.16.1,!=0.17.*,!=0.18.*,<0.20"
#: Set to 1 to run with a version outside the range anyway (at your own risk).
SKIP_ENV = "MEGATRON_DUALPIPE_SKIP_VERSION_CHECK"

#: The one sentence every message, doc and help text uses.
SUPPORTED_TEXT = ("megatron-core 0.16.1 with Megatron-LM core_v0.16.1, or megatron-core 0.19.x with Megatron-LM "
                  "core_v0.19.0 (0.17 and 0.18 are not supported)")


#: The oldest torch whose ``new_group`` keeps the ranks' order (``sort_ranks=False``): the reversed group's.
TORCH_FOR_TWO_CHUNKS = "2.12"


def torch_problem() -> Optional[str]:
    """Why this torch cannot build DualPipe's process groups, or None (the feature, not a version)."""
    import inspect

    import torch
    import torch.distributed as dist

    if "sort_ranks" in inspect.signature(dist.new_group).parameters:
        return None
    return (f"needs torch >= {TORCH_FOR_TWO_CHUNKS} (torch.distributed.new_group(sort_ranks=False) builds its "
            f"reversed pipeline group), found torch {torch.__version__}: pip install 'torch>={TORCH_FOR_TWO_CHUNKS}' "
            f"(the build for your CUDA)")


def parse(version: str) -> Tuple[int, ...]:
    """``"0.19.0rc2"`` -> ``(0, 19, 0)``: the leading numeric release parts."""
    m = re.match(r"\d+(?:\.\d+)*", str(version))
    return tuple(int(p) for p in m.group().split(".")) if m else ()


def supported(version: str) -> bool:
    """True when ``version`` (megatron-core) lies in the supported range."""
    v = parse(version)
    v3 = (v + (0, 0, 0))[:3]
    return bool(v) and v3[:2] in SERIES and v3 >= SERIES[v3[:2]]


def skipped() -> bool:
    return os.environ.get(SKIP_ENV) == "1"


def problem(version: Optional[str], where: str = "megatron-core") -> Optional[str]:
    """One line saying that ``version`` is unsupported and what to do, or None (also under :data:`SKIP_ENV`)."""
    if skipped() or (version is not None and supported(version)):
        return None
    found = f"{where} {version}" if version else f"no version of {where}"
    return (f"found {found}; megatron-dualpipe supports {SUPPORTED_TEXT}: install one of those "
            f"(pip install '{REQUIREMENT}', or check out one of those Megatron-LM tags), or set {SKIP_ENV}=1 "
            f"to try anyway")


def tag_of(core_version: Optional[str]) -> Optional[str]:
    """The tested Megatron-LM tag that carries ``core_version``, or None."""
    return next((tag for tag, v in TAGS.items() if v == core_version), None)


def installed_core_version() -> Optional[str]:
    """The version of the importable ``megatron.core`` (package_info, no torch import), or None."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return checkout_core_version(os.path.dirname(os.path.dirname(list(spec.submodule_search_locations)[0])))


def checkout_core_version(root: str) -> Optional[str]:
    """The megatron-core version in ``root/megatron/core/package_info.py``, or None."""
    info = os.path.join(root, "megatron", "core", "package_info.py")
    try:
        text = open(info, encoding="utf-8").read()
    except OSError:
        return None
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None

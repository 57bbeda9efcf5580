"""What one change of a Megatron attribute is (:class:`Patch`), and how it is applied, undone and
scoped: :func:`apply` records the exact object it replaced (or that there was none), so :func:`restore`
puts that same object back. Standard library only.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

__all__ = ["MISSING", "Versions", "ALL_VERSIONS", "Patch", "Swap", "Applied", "PatchSet", "resolve", "current",
           "apply", "restore", "scoped", "megatron_core_version", "active_scoped"]

INSTALLED, SCOPED, INSTANCE = "installed", "scoped", "instance"


class _Missing:
    def __repr__(self):
        return "<missing>"


#: Stands for "the attribute did not exist" (restoring it deletes the attribute).
MISSING = _Missing()


def _version_tuple(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


@dataclass(frozen=True)
class Versions:
    """The megatron-core versions a patch applies to: from ``first`` (inclusive) to ``below``
    (exclusive); either may be open. ``Versions("0.19")`` is 0.19.0 and later."""

    first: Optional[str] = None
    below: Optional[str] = None

    def __contains__(self, version) -> bool:
        if version is None:  # unknown: every patch applies (the installed Megatron decides)
            return True
        v = _version_tuple(version) if isinstance(version, str) else tuple(version)
        return ((self.first is None or v >= _version_tuple(self.first))
                and (self.below is None or v < _version_tuple(self.below)))

    def __str__(self) -> str:
        bounds = [f">= {self.first}" if self.first else "", f"< {self.below}" if self.below else ""]
        return ", ".join(b for b in bounds if b) or "all"


ALL_VERSIONS = Versions()


@dataclass(frozen=True)
class Patch:
    """``module.attribute`` is replaced by ``make(original)`` (:data:`MISSING` if there is none); a
    ``"package.module:name"`` string is imported on first use. Scoped and instance patches have no
    ``make``: the caller gives the replacement (:meth:`to`, :meth:`made_by`)."""

    module: str
    attribute: str
    make: Union[Callable[[Any], Any], str, None]
    why: str
    versions: Versions = ALL_VERSIONS
    only_if_missing: bool = False
    kind: str = INSTALLED
    where: str = ""  # who applies a scoped / instance patch (for the listing)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"

    def replacement_for(self, original):
        make = self.make
        if isinstance(make, str):
            module, _, name = make.partition(":")
            make = getattr(importlib.import_module(module), name)
        if make is None:
            raise TypeError(f"{self.target} is a {self.kind} patch: give its replacement (Patch.to / made_by)")
        return make(original)

    def to(self, replacement, on=None) -> "Swap":
        """This patch with ``replacement`` (for :func:`scoped` or :func:`apply`), on ``on`` if given."""
        return Swap(self, lambda original: replacement, on)

    def made_by(self, make: Callable[[Any], Any], on=None) -> "Swap":
        """This patch with ``make(original)`` as the replacement."""
        return Swap(self, make, on)

    def describe_make(self) -> str:
        if isinstance(self.make, str):
            return self.make
        if self.make is None:
            return f"given by {self.where}" if self.where else "given by the caller"
        name = getattr(self.make, "__qualname__", None) or type(self.make).__name__
        return f"{getattr(self.make, '__module__', '?')}:{name}"


@dataclass(frozen=True)
class Swap:
    """A patch with the replacement a caller chose, and the object it goes on (None: the module)."""

    patch: Patch
    make: Callable[[Any], Any]
    on: Any = None


@dataclass(frozen=True)
class Applied:
    """One applied patch: where it went, what was there, what was put there."""

    patch: Patch
    owner: Any
    name: str
    saved: Any  # the owner's own attribute before (MISSING if it had none)
    replacement: Any


def resolve(patch: Patch, on=None) -> Tuple[Any, str]:
    """The object that holds the attribute (module, class, or ``on``) and the attribute's name."""
    *path, name = patch.attribute.split(".")
    if on is not None:
        return on, name
    owner = importlib.import_module(patch.module)
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def current(owner: Any, name: str) -> Any:
    """The owner's *own* attribute (not an inherited one), or :data:`MISSING`."""
    try:
        return vars(owner).get(name, MISSING)
    except TypeError:  # no __dict__ (slots)
        return getattr(owner, name, MISSING)


def apply(patch: Union[Patch, Swap]) -> Optional[Applied]:
    """Apply one patch (or a :class:`Swap`); returns :class:`Applied`, or None when it is not needed here."""
    swap = patch if isinstance(patch, Swap) else Swap(patch, patch.replacement_for)
    owner, name = resolve(swap.patch, swap.on)
    saved = current(owner, name)
    if swap.patch.only_if_missing and saved is not MISSING:
        return None
    replacement = swap.make(getattr(owner, name, MISSING))
    setattr(owner, name, replacement)
    return Applied(swap.patch, owner, name, saved, replacement)


def restore(applied: Applied) -> bool:
    """Put the saved object back (delete the attribute if there was none); False when someone
    replaced our replacement in the meantime (it is restored anyway)."""
    ours = current(applied.owner, applied.name) is applied.replacement
    if applied.saved is not MISSING:
        setattr(applied.owner, applied.name, applied.saved)
    elif current(applied.owner, applied.name) is not MISSING:
        delattr(applied.owner, applied.name)
    return ours


_VERSION: Dict[str, Optional[str]] = {}


def megatron_core_version() -> Optional[str]:
    """The installed megatron-core's version, or None; read from its source while it is not imported."""
    if _VERSION.get("version") is None:
        info = sys.modules.get("megatron.core.package_info")
        _VERSION["version"] = _source_version() if info is None else getattr(info, "__version__", None)
    return _VERSION["version"]


def _source_version() -> Optional[str]:
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    for path in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = open(f"{path}/package_info.py", encoding="utf-8").read()
        except OSError:
            continue
        parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
        if all(parts):
            return ".".join(m.group(1) for m in parts)
    return None


_SCOPED_NOW: Dict[str, int] = {}  # target -> how many scoped() blocks hold it now


def active_scoped() -> Dict[str, int]:
    """target -> number of :func:`scoped` blocks replacing it right now (this process)."""
    return {t: n for t, n in _SCOPED_NOW.items() if n}


@contextlib.contextmanager
def scoped(*swaps: Swap, version: Optional[str] = None) -> Iterator[List[Applied]]:
    """Within the block each swap's attribute holds its replacement; on exit (also on an exception) the
    very object it had, in reverse order. Swaps for another megatron-core than ``version`` are skipped."""
    version = megatron_core_version() if version is None else version
    applied: List[Applied] = []
    try:
        for swap in swaps:
            if version in swap.patch.versions and (done := apply(swap)) is not None:
                applied.append(done)
                _SCOPED_NOW[swap.patch.target] = _SCOPED_NOW.get(swap.patch.target, 0) + 1
        yield applied
    finally:
        for done in reversed(applied):
            restore(done)
            _SCOPED_NOW[done.patch.target] -= 1


@dataclass
class PatchSet:
    """Patches installed and uninstalled together, in order (all or none: a failure part way
    restores what was applied). Patches for other megatron-core versions are skipped and listed."""

    name: str
    patches: Sequence[Patch]
    applied: List[Applied] = field(default_factory=list)
    not_needed: List[Patch] = field(default_factory=list)
    other_version: List[Patch] = field(default_factory=list)
    installed: bool = False
    version: Optional[str] = None  # the megatron-core version it was installed for

    def install(self, version: Optional[str] = None) -> bool:
        """Apply every patch of the set that applies to ``version`` (default: the installed
        megatron-core's). Idempotent; returns True if it installed now."""
        if self.installed:
            return False
        version = megatron_core_version() if version is None else version
        applied, not_needed, other = [], [], []
        try:
            for patch in self.patches:
                if version not in patch.versions:
                    other.append(patch)
                elif (done := apply(patch)) is None:
                    not_needed.append(patch)
                else:
                    applied.append(done)
        except BaseException:
            for done in reversed(applied):  # never leave a set half-applied
                restore(done)
            raise
        self.applied, self.not_needed, self.other_version, self.installed = applied, not_needed, other, True
        self.version = version
        return True

    def uninstall(self) -> List[str]:
        """Undo :meth:`install`: every patched attribute gets back the object that was there.
        Returns the targets that someone else had replaced again meanwhile (restored anyway)."""
        overwritten = [done.patch.target for done in reversed(self.applied) if not restore(done)]
        self.applied, self.not_needed, self.other_version, self.installed = [], [], [], False
        return overwritten

    def state(self, patch: Patch) -> str:
        """``active``, ``inactive``, ``not needed`` (an only-if-missing target that exists),
        ``not for megatron-core X`` or ``replaced by someone else``."""
        if any(p is patch for p in self.not_needed):
            return "not needed"
        if any(p is patch for p in self.other_version):
            return f"not for megatron-core {self.version} (applies to {patch.versions})"
        for done in self.applied:
            if done.patch is patch:
                return "active" if current(done.owner, done.name) is done.replacement else "replaced by someone else"
        return "inactive"

    def status(self) -> List[Tuple[Patch, str]]:
        return [(p, self.state(p)) for p in self.patches]

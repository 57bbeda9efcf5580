"""docs/architecture.md names only what exists: every module path and ``module.symbol`` in backticks.

Why: the map of who owns which fact is read to find code; a name it keeps after a move or a
deletion sends the reader to nothing (it named ``forward_backward._finalize`` and ``demo.py`` long
after both were gone). A path (``schedule/registry.py``, ``tests/...py::test_x``, ``cli/``) must
exist in the package or the checkout; a dotted name whose first part is one of the package's modules
(``executor.runner.Program``, ``forward_backward._finalize``) or one of its top-level names
(``GradReduction.finish``) must import and resolve. Other backticked text (flags, commands,
Megatron's own names) is left alone.
"""
from __future__ import annotations

import ast
import importlib
import pathlib
import re
from functools import lru_cache
from typing import Dict, List, Optional, Set

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_dualpipe"
DOC = ROOT / "docs" / "architecture.md"

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"[\w./-]+")
_FILE = re.compile(r".*\.(py|md|sh|txt|json|toml|cfg|png|svg|yaml)$")
#: Files named in the doc that are not this checkout's: Megatron-LM's training script.
FOREIGN_FILES = {"pretrain_gpt.py"}


def _modules() -> Dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if "stand_ins" not in path.parts:  # the CPU mode's copies of other packages' modules
            found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


MODULES = _modules()


@lru_cache(maxsize=None)
def _top_level_names(module: str) -> Set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def backticked(text: str) -> List[str]:
    """The backticked spans of ``text`` (fenced blocks left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def _path_problem(token: str) -> Optional[str]:
    path, _, test = token.partition("::")
    if path.startswith("...") or path in FOREIGN_FILES:
        return None
    if "/" not in path.rstrip("/"):  # a file named in a sentence about its folder
        hits = list(PKG.rglob(path)) + list((ROOT / "tests").rglob(path)) + [p for p in [ROOT / path] if p.exists()]
    else:
        hits = [base / path for base in (PKG, ROOT, ROOT / "tests") if (base / path).exists()]
    if not hits:
        return f"{token}: no such file or folder"
    name = test.split("[")[0]
    if name and "..." not in name and not any(f"def {name}(" in h.read_text(encoding="utf-8")
                                               for h in hits if h.is_file()):
        return f"{token}: no test {name} in {path}"
    return None


def _resolve(module: str, attrs: List[str]) -> bool:
    obj = importlib.import_module(module)
    for attr in attrs:
        if isinstance(obj, type) and any(attr in getattr(c, "__annotations__", {}) for c in obj.__mro__):
            return True  # a dataclass field (no class attribute without a default)
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def _dotted_problem(token: str) -> Optional[str]:
    parts = token.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        owners = [m for m in MODULES if m == prefix or m.endswith("." + prefix)]
        if owners:
            if any(_resolve(m, parts[k:]) for m in owners):
                return None
            return f"{token}: {'.'.join(parts[k:])} is not in {' or '.join(owners)}"
    owners = [m for m in MODULES if parts[0] in _top_level_names(m)]
    if owners and not any(_resolve(m, parts) for m in owners):
        return f"{token}: {'.'.join(parts[1:])} is not in {parts[0]} ({' or '.join(owners)})"
    return None  # not a name of this package (Megatron's, torch's)


def problem(token: str) -> Optional[str]:
    """Why ``token`` names nothing that exists, or None (also for text that names no code)."""
    token = re.sub(r"\(.*\)$", "", token.strip())
    if _PATH.fullmatch(token.partition("::")[0]) and ("::" in token or _FILE.match(token) or token.endswith("/")):
        return _path_problem(token)
    token = token.replace("/", ".")  # mcore/validation.check_call: a module's file and one of its names
    if _DOTTED.fullmatch(token):
        return _dotted_problem(token)
    return None


def test_architecture_doc_names_only_what_exists():
    tokens = sorted(set(backticked(DOC.read_text(encoding="utf-8"))))
    problems = [p for p in map(problem, tokens) if p]
    print(f"\n{len(tokens)} backticked names in docs/architecture.md; missing: {problems}")
    assert not problems, "docs/architecture.md names what does not exist:\n" + "\n".join(problems)


def test_the_check_catches_a_missing_module_symbol_and_path():
    assert problem("forward_backward._finalize_that_never_was")
    assert problem("GradReduction.no_such_method")
    assert problem("schedule/no_such_module.py")
    assert problem("tests/schedule/test_layers.py::test_no_such_test")
    assert problem("schedule.registry.ScheduleSpec") is None and problem("tests/schedule/test_layers.py") is None
    assert problem("config.finalize_model_grads_func") is None  # Megatron's, not this package's
    assert problem("Program.step_ops") is None  # a dataclass field

"""The package's layers import downward only: no import circle, no import running up a layer, and no
``from .x import _name`` across modules (a private name is a module's own business).

The layers, lowest first, and what each may import of the package (docs/architecture.md draws them):
the schedule layer is pure data and standard library; the executor runs it with torch; the
megatron-core glue and the CPU mode sit above; Megatron-LM's training hooks above them; drawings,
benchmarks and applications above those; the command line on top.
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict
from typing import Dict, List, Set, Tuple

import megatron_dualpipe

PKG = "megatron_dualpipe"
ROOT = os.path.dirname(os.path.abspath(megatron_dualpipe.__file__))

#: top-level part of the package -> the parts it may import (itself always).
MAY_IMPORT: Dict[str, Set[str]] = {
    # foundations: standard library only
    "versions": set(),
    # launch/'s modules that start and stop processes (PROCESSES)
    "processes": set(),
    "schedule": set(),
    # what a schedule costs on a model, and which to use (standard library only too)
    "costs": {"schedule"},
    # configs/, patches/, scripts/: the checkout's or the wheel's copies
    "project_files": set(),
    # the one patching mechanism for Megatron (and its manifest)
    "hooks": {"versions"},
    "executor": {"schedule"},
    "pictures": {"schedule", "executor"},
    "bench": {"schedule", "costs", "executor", "pictures", "processes"},
    "cpu": {"hooks", "versions"},
    "mcore": {"schedule", "costs", "executor", "cpu", "hooks", "versions"},
    "megatron_lm": {"schedule", "executor", "mcore", "cpu", "hooks", "versions", "project_files"},
    # Megatron-Bridge's pretrain(): the same megatron-core glue, hooked into Bridge's training loop
    "bridge": {"schedule", "executor", "mcore", "cpu", "hooks", "versions", "megatron_lm"},
    # the launcher and the checks before torchrun
    "launch": {"schedule", "executor", "mcore", "cpu", "hooks", "versions", "megatron_lm", "processes"},
    # the proof harness: the tiny GPT and the equality and no-hang checks (the tests, the selftest; the
    # main job builds the same tiny GPT)
    "proof": {"schedule", "executor", "mcore", "cpu", "hooks", "versions"},
    "apps": {"schedule", "costs", "executor", "pictures", "bench", "mcore", "cpu", "hooks", "versions",
             "megatron_lm", "processes", "launch", "proof"},
    "selftest": {"schedule", "costs", "executor", "pictures", "bench", "mcore", "cpu", "hooks", "versions",
                 "megatron_lm", "apps", "processes", "proof"},
    "cli": {"schedule", "costs", "executor", "pictures", "bench", "mcore", "cpu", "hooks", "versions", "megatron_lm",
            "apps", "selftest", "launch", "processes", "project_files"},
    "__main__": {"cli"},
    "(root)": set(),
}

#: Modules of launch/ that form a foundation of their own, standard library only: starting and
#: stopping processes, Ctrl-C (the launcher beside them sits above megatron_lm).
PROCESSES = {"launch.processes", "launch.interrupts", "launch.ports", "launch.own_session", "launch.spawn"}


def _modules() -> Dict[str, str]:
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


MODULES = _modules()


def _part(module: str) -> str:
    parts = module.split(".")
    if ".".join(parts[1:3]) in PROCESSES:
        return "processes"
    return parts[1] if len(parts) > 1 else "(root)"


def _imports(module: str, path: str) -> List[Tuple[str, List[str], int]]:
    """(imported module, names, line) for every import of the package in ``module``."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PKG or target.startswith(PKG + "."):
                found.append((target, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.startswith(PKG + ".")]
    return found


def _edges() -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for target, names, _ in _imports(module, path):
            hits = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            edges[module].update(hits or ([target] if target in MODULES else []))
    return edges


def _circles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def test_every_part_of_the_package_has_a_layer():
    unknown = sorted({_part(m) for m in MODULES} - set(MAY_IMPORT))
    assert not unknown, f"add these to MAY_IMPORT (and docs/architecture.md): {unknown}"


def test_no_import_circle():
    circles = _circles(_edges())
    print(f"{len(MODULES)} modules, circles: {circles}")
    assert not circles, f"import circles: {circles}"


def test_no_import_runs_up_a_layer():
    upward = []
    for module, path in MODULES.items():
        for imported, names, line in _imports(module, path):
            # ``from .launch import interrupts``: the submodule's layer, not its package's
            for target in [f"{imported}.{n}" for n in names if f"{imported}.{n}" in MODULES] or [imported]:
                a, b = _part(module), _part(target)
                if a != b and b not in MAY_IMPORT[a] and target != PKG:  # the root holds only __version__
                    upward.append(f"{path}:{line}: {module} ({a}) imports {target} ({b})")
    print("\n".join(upward) or "no upward import")
    assert not upward


def test_no_private_name_imported_across_modules():
    private = []
    for module, path in MODULES.items():
        for target, names, line in _imports(module, path):
            for name in names:
                if name.startswith("_") and not name.startswith("__") and f"{target}.{name}" not in MODULES \
                        and target != module:
                    private.append(f"{path}:{line}: from {target} import {name}")
    print("\n".join(private) or "no private import")
    assert not private


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The rules can fail: a made-up pair of modules importing each other is a circle."""
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert "cli" not in MAY_IMPORT["schedule"] and "mcore" not in MAY_IMPORT["executor"]

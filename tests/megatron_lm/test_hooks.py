"""The one patching mechanism (megatron_dualpipe/hooks) and its manifest of every Megatron change.

The mechanism is tested on a stand-in module (standard library, milliseconds); the real
Megatron-LM install runs in a subprocess (``megatron-dualpipe hooks --install``), which checks that
uninstall() puts back the very objects that were there.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from megatron_dualpipe import hooks
from megatron_dualpipe.hooks import manifest
from megatron_dualpipe.hooks.mechanism import INSTALLED, MISSING, Patch, PatchSet, Versions, apply, scoped

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def fake():
    """A module ``fake_megatron`` with two functions and a class, removed afterwards."""
    mod = types.ModuleType("fake_megatron")

    def f():
        return "f"

    def g():
        return "g"

    class Box:
        def method(self):
            return "method"

    mod.f, mod.g, mod.Box = f, g, Box
    sys.modules["fake_megatron"] = mod
    yield mod
    del sys.modules["fake_megatron"]


def _wrap(original):
    return lambda: "wrapped " + original()


def test_install_uninstall_restores_every_attribute_by_identity(fake):
    before = {"f": fake.f, "g": fake.g, "method": vars(fake.Box)["method"]}
    patches = PatchSet("t", (Patch("fake_megatron", "f", _wrap, "why f"),
                             Patch("fake_megatron", "g", lambda o: (lambda: "new"), "why g"),
                             Patch("fake_megatron", "Box.method", lambda o: (lambda self: "patched"), "why m"),
                             Patch("fake_megatron", "added", lambda o: 42, "why added", only_if_missing=True)))
    assert patches.install(version="0.16.1") is True
    assert patches.install(version="0.16.1") is False  # idempotent
    print(f"\ninstalled: {[(p.target, s) for p, s in patches.status()]}")
    assert (fake.f(), fake.g(), fake.Box().method(), fake.added) == ("wrapped f", "new", "patched", 42)
    assert [s for _, s in patches.status()] == ["active"] * 4
    assert patches.uninstall() == []
    assert fake.f is before["f"] and fake.g is before["g"] and vars(fake.Box)["method"] is before["method"]
    assert not hasattr(fake, "added")
    assert [s for _, s in patches.status()] == ["inactive"] * 4


def test_a_failing_patch_leaves_nothing_applied(fake):
    f = fake.f
    patches = PatchSet("t", (Patch("fake_megatron", "f", _wrap, "ok"), Patch("fake_megatron", "nope.x", _wrap, "bad")))
    with pytest.raises(AttributeError):
        patches.install(version="0.16.1")
    assert fake.f is f and not patches.installed


def test_version_gated_entry_is_skipped_outside_its_range(fake):
    f, g = fake.f, fake.g
    old = Patch("fake_megatron", "f", _wrap, "before 0.19", Versions(below="0.19"))
    new = Patch("fake_megatron", "f", lambda o: (lambda: "0.19 way"), "from 0.19", Versions("0.19"))
    other = Patch("fake_megatron", "g", _wrap, "0.17 and 0.18 only", Versions("0.17", "0.19"))
    for version, want_f, want_g in (("0.16.1", "wrapped f", "g"), ("0.19.0", "0.19 way", "g"),
                                    ("0.18.2", "wrapped f", "wrapped g")):
        patches = PatchSet("t", (old, new, other))
        patches.install(version=version)
        states = [s for _, s in patches.status()]
        print(f"\n{version}: {states}")
        assert (fake.f(), fake.g()) == (want_f, want_g)
        assert sum(s.startswith("not for megatron-core") for s in states) == 3 - len(patches.applied)
        patches.uninstall()
        assert fake.f is f and fake.g is g
    assert "0.19.0" not in Versions(below="0.19") and "0.19.0rc1" in Versions("0.19") and "0.16.1" in Versions()


def test_scoped_swaps_restore_on_exit_and_on_an_exception(fake):
    f, box = fake.f, fake.Box()
    p = Patch("fake_megatron", "f", None, "scoped", kind="scoped")
    m = Patch("fake_megatron", "Box.method", None, "per object", kind="instance")
    with scoped(p.to(lambda: "inner"), m.to(lambda: "on this box", on=box), version="0.16.1"):
        assert fake.f() == "inner" and box.method() == "on this box" and fake.Box().method() == "method"
        with scoped(p.made_by(_wrap), version="0.16.1"):  # nested: wraps the outer replacement
            assert fake.f() == "wrapped inner"
        assert fake.f() == "inner"
    assert fake.f is f and "method" not in vars(box)
    with pytest.raises(RuntimeError), scoped(p.to(lambda: "x"), version="0.16.1"):
        raise RuntimeError("inside")
    assert fake.f is f
    with scoped(Patch("fake_megatron", "f", None, "old", Versions(below="0.16"), kind="scoped").to(None),
                version="0.16.1") as applied:
        assert applied == [] and fake.f is f  # not for this version: skipped


def test_installed_patch_without_make_is_refused(fake):
    with pytest.raises(TypeError, match="give its replacement"):
        apply(Patch("fake_megatron", "f", None, "scoped", kind="scoped"))
    assert apply(Patch("fake_megatron", "f", _wrap, "x", only_if_missing=True)) is None


def test_manifest_entries_are_complete_and_unique():
    rows = [(part, p) for part, ps in manifest.PARTS.items() for p in ps]
    print(f"\n{len(rows)} patched Megatron attributes: " + ", ".join(f"{p.target} ({p.kind})" for _, p in rows))
    keys = [(p.target, str(p.versions)) for _, p in rows]
    assert len(keys) == len(set(keys))
    for part, p in rows:
        assert p.why and p.module.startswith("megatron.")
        assert (p.make is not None) == (p.kind == INSTALLED) == (part in manifest.INSTALLED_PARTS)
        if isinstance(p.make, str):  # names a function that exists (imported lazily at install)
            module, _, name = p.make.partition(":")
            assert module.startswith("megatron_dualpipe.")
            path = ROOT / (module.replace(".", "/") + ".py")
            assert f"def {name}(" in path.read_text(encoding="utf-8"), p.make


def _megatron_module_aliases(tree):
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name.startswith("megatron.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            names |= {a.asname or a.name for a in node.names}
    return names


#: Assignments that are no patch: the CPU replacement of ``_get_write_results_queue`` fills the
#: module's cache as Megatron's own function does.
NOT_PATCHES = ("filesystem_async._results_queue",)


def test_no_megatron_attribute_is_assigned_outside_the_mechanism():
    """Every change of a Megatron module goes through hooks (so it is in the manifest): no
    ``module.attr = ...`` / ``setattr(module, ...)`` on a name imported from megatron elsewhere."""
    found = []
    for path in sorted((ROOT / "megatron_dualpipe").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = _megatron_module_aliases(tree)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr") and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in aliases \
                        and f"{t.value.id}.{t.attr}" not in NOT_PATCHES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {t.value.id}.{t.attr}")
    print(f"\nassignments to megatron modules outside hooks/: {found}")
    assert found == []


def test_hooks_command_prints_the_manifest():
    from megatron_dualpipe.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["hooks"]) == 0
    text = out.getvalue()
    print(text[:400])
    for part, patches in manifest.PARTS.items():
        assert f"{part}: {len(patches)} patches" in text
        for p in patches:
            assert p.target in text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["hooks", "--json"]) == 0
    doc = json.loads(out.getvalue())
    assert [r["target"] for r in doc["patches"]] == [p.target for ps in manifest.PARTS.values() for p in ps]
    assert all(r["why"] for r in doc["patches"])


def test_install_into_megatron_lm_and_uninstall_restores_every_attribute():
    """The real thing: every installed part applied to Megatron-LM, listed active, then every
    attribute back (identity), in a subprocess so this process never imports megatron.training."""
    path = os.environ.get("MEGATRON_LM_PATH", "/work/vendor/core_v0.16.1")
    if not os.path.isfile(os.path.join(path, "pretrain_gpt.py")):
        pytest.skip("set MEGATRON_LM_PATH to a Megatron-LM checkout")
    for mod in ("six", "regex", "yaml", "pydantic"):
        pytest.importorskip(mod, reason="Megatron-LM's training code needs six regex pyyaml pydantic")
    out = subprocess.run([sys.executable, "-m", "megatron_dualpipe", "hooks", "--install", "--megatron-lm", path,
                          "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    states = {r["target"]: r["state"] for r in doc["patches"] if r["kind"] == INSTALLED}
    print(f"\nmegatron-core {doc['megatron_core']}: {len(states)} installed patches, states "
          f"{sorted(set(states.values()))}; restore mismatches: {doc['restore_mismatches']}")
    assert doc["restore_mismatches"] == []
    assert set(states.values()) == {"active"}
    assert len(states) == sum(len(manifest.PARTS[p]) for p in manifest.INSTALLED_PARTS)
    assert MISSING is not None and hooks.installed() == ()

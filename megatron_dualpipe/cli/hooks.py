"""``megatron-dualpipe hooks``: every Megatron attribute megatron-dualpipe changes, and which are active.

A fresh process has nothing installed, so by default the installed parts read ``inactive``;
``--install`` installs them here first (with ``--megatron-lm PATH``: a Megatron-LM checkout put
on ``sys.path``), prints the table, then uninstalls them and checks that every patched attribute
holds its original object again. Scoped patches are active only inside the block that swaps them
and per-object ones only on their object; both are listed with who applies them. The CPU mode's
redirections are the same mechanism, listed by ``megatron-dualpipe cpu-mode``.
"""

from __future__ import annotations

import json
import sys
import textwrap

from .args import Command

HELP = "list every Megatron attribute megatron-dualpipe patches, and whether it is active (--install: try it here)"


def configure(p):
    p.add_argument("--install", action="store_true",
                   help="install the parts here, print, then uninstall them and check the restore")
    p.add_argument("--megatron-lm", metavar="PATH",
                   help="a Megatron-LM checkout to put on sys.path first (its training code is patched too)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def run(args) -> int:
    from .. import hooks
    from ..hooks import manifest
    from ..hooks.mechanism import current, megatron_core_version, resolve

    if args.megatron_lm:
        sys.path.insert(0, args.megatron_lm)
    restored = None
    if args.install and not hooks.installed():
        parts = list(manifest.INSTALLED_PARTS if args.megatron_lm else
                     [p for p in manifest.INSTALLED_PARTS if not p.startswith("megatron-lm")])
        if args.megatron_lm:
            from ..megatron_lm import triton_stub

            triton_stub.preimport_triton_users()
        snapshot = {}
        version = megatron_core_version()
        for part in parts:
            for patch in manifest.PARTS[part]:
                if version not in patch.versions:  # skipped by install(): its module may not exist here
                    continue
                owner, name = resolve(patch)
                snapshot[patch.target] = (owner, name, current(owner, name))
            if part == "python":  # before resolving Megatron-LM's modules (typing.override on 3.11)
                hooks.install([part])
        hooks.install(parts)
        rows = hooks.status()
        hooks.uninstall(parts)
        restored = [t for t, (owner, name, obj) in snapshot.items() if current(owner, name) is not obj]
    else:
        rows = hooks.status()
    version = megatron_core_version()
    if args.json:
        print(json.dumps({"megatron_core": version, "restore_mismatches": restored, "patches": [
            {"part": part, "target": p.target, "kind": p.kind, "state": state, "versions": str(p.versions),
             "replacement": p.describe_make(), "why": p.why} for part, p, state in rows]}, indent=1))
    else:
        _print_table(rows, version, restored)
    return 1 if restored else 0


def _print_table(rows, version, restored):
    print(f"megatron-core here: {version or 'not importable'}. {len(rows)} Megatron attributes are changed by "
          f"megatron-dualpipe (CPU-mode redirections: megatron-dualpipe cpu-mode).")
    part = None
    for p, patch, state in rows:
        if p != part:
            part = p
            print(f"\n{p}: {sum(1 for q, _, _ in rows if q == p)} patches")
        versions = "" if str(patch.versions) == "all" else f"  [megatron-core {patch.versions}]"
        print(f"  {state:10s} {patch.target}{versions}")
        print(textwrap.fill(f"{patch.why} -> {patch.describe_make()}", width=100, initial_indent=" " * 13,
                            subsequent_indent=" " * 13))
    if restored is not None:
        verdict = "every patched attribute is back" if not restored else f"NOT restored: {', '.join(restored)}"
        print(f"\nuninstall(): {verdict}")


COMMAND = Command("hooks", HELP, configure, run)

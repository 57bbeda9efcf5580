"""``megatron-dualpipe hooks``: every Megatron attribute megatron-dualpipe changes, and which are active.
``--install`` installs the parts here, prints, then uninstalls them and checks that every patched
attribute holds its original object again. (The CPU mode's redirections: ``cpu-mode``.)"""

from __future__ import annotations

import json
import sys

from .args import Command, not_restored, print_by_part, snapshot

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
    from ..hooks.mechanism import megatron_core_version

    if args.megatron_lm:
        sys.path.insert(0, args.megatron_lm)
    restored = None
    if args.install and not hooks.installed():
        parts = list(manifest.INSTALLED_PARTS if args.megatron_lm else
                     [p for p in manifest.INSTALLED_PARTS if not p.startswith("megatron-lm")])
        if args.megatron_lm:
            from ..megatron_lm import triton_stub

            triton_stub.preimport_triton_users()
        saved = {}
        for part in parts:
            saved.update(snapshot(manifest.PARTS[part]))
            if part == "python":  # before resolving Megatron-LM's modules (typing.override on 3.11)
                hooks.install([part])
        hooks.install(parts)
        rows = hooks.status()
        hooks.uninstall(parts)
        restored = not_restored(saved)
    else:
        rows = hooks.status()
    version = megatron_core_version()
    if args.json:
        print(json.dumps({"megatron_core": version, "restore_mismatches": restored, "patches": [
            {"part": part, "target": p.target, "kind": p.kind, "state": state, "versions": str(p.versions),
             "replacement": p.describe_make(), "why": p.why} for part, p, state in rows]}, indent=1))
    else:
        print(f"megatron-core here: {version or 'not importable'}. {len(rows)} Megatron attributes are changed by "
              f"megatron-dualpipe (CPU-mode redirections: megatron-dualpipe cpu-mode).")
        print_by_part(rows, "patches", _describe, restored, "uninstall")
    return 1 if restored else 0


def _describe(patch, state):
    versions = "" if str(patch.versions) == "all" else f"  [megatron-core {patch.versions}]"
    return f"  {state:10s} {patch.target}{versions}", f"{patch.why} -> {patch.describe_make()}"


COMMAND = Command("hooks", HELP, configure, run)

"""``megatron-dualpipe cpu-mode``: list every CPU redirection and whether it is active.

A fresh process has CPU mode off, so by default every row reads ``inactive``; ``--enable``
switches it on in this process first (the megatron-core part, plus Megatron-LM's with
``--megatron-lm PATH``), prints the table, then switches it off and checks that every patched
attribute holds its original object again (when CPU mode was already on in this process, it is
listed as it is and left on).
"""

from __future__ import annotations

import json
import sys
import textwrap

from .args import Command

HELP = "list every CPU-mode redirection and whether it is active (--enable: try it here)"


def configure(p):
    p.add_argument("--enable", action="store_true",
                   help="switch CPU mode on here, print, then switch it off and check the restore")
    p.add_argument("--megatron-lm", metavar="PATH",
                   help="with --enable: a Megatron-LM checkout (core_v0.16.1 or core_v0.19.0) whose training code to redirect "
                        "too")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def run(args) -> int:
    import torch

    from .. import cpu

    if args.megatron_lm and not args.enable:
        raise ValueError("--megatron-lm needs --enable")
    cuda = torch.cuda.is_available()
    snapshot = None
    if args.enable and not cuda and not cpu.active():  # never switch off a CPU mode we did not start
        snapshot = _enable(args.megatron_lm)
    rows = cpu.status()
    restored = None
    if snapshot is not None:
        cpu.disable()
        restored = _changed_since(snapshot)
    if args.json:
        print(json.dumps({"cuda_available": cuda, "restore_mismatches": restored, "redirections": [
            {"part": part, "target": r.target, "state": state, "why": r.why} for part, r, state in rows]},
            indent=1))
    else:
        _print_table(rows, cuda, restored)
    return 1 if restored else 0


def _enable(megatron_lm_path):
    from .. import cpu
    from ..cpu.redirection import current, resolve
    from ..hooks.mechanism import megatron_core_version

    if megatron_lm_path:
        sys.path.insert(0, megatron_lm_path)
        from ..megatron_lm import triton_stub

        triton_stub.preimport_triton_users()
    wanted = [p for p in cpu.PARTS if megatron_lm_path or p == "megatron-core"]
    version = megatron_core_version()
    snapshot = {}
    for part in wanted:
        for r in cpu.redirections(part):
            if version not in r.versions:  # enable() skips it too: its module may not exist here
                continue
            owner, name = resolve(r)
            snapshot[r.target] = (owner, name, current(owner, name))
    cpu.enable(megatron_lm=bool(megatron_lm_path))
    return snapshot


def _changed_since(snapshot):
    from ..cpu.redirection import current

    return [target for target, (owner, name, obj) in snapshot.items() if current(owner, name) is not obj]


def _print_table(rows, cuda, restored):
    if cuda:
        print("CUDA is available here: CPU mode is never active on this machine.")
    else:
        print("No CUDA here: CPU mode switches on by itself where megatron_dualpipe runs Megatron "
              "(tests, demo, pretrain_gpt.py through the launcher or the patch).")
    part = None
    for p, r, state in rows:
        if p != part:
            part = p
            print(f"\n{p}: {sum(1 for q, _, _ in rows if q == p)} redirections")
        print(f"  {state:10s} {r.target}")
        print(textwrap.fill(r.why, width=100, initial_indent=" " * 13, subsequent_indent=" " * 13))
    if restored is not None:
        verdict = "every patched attribute is back" if not restored else f"NOT restored: {', '.join(restored)}"
        print(f"\ndisable(): {verdict}")


COMMAND = Command("cpu-mode", HELP, configure, run)

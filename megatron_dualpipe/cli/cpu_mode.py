"""``megatron-dualpipe cpu-mode``: list every CPU redirection and whether it is active. ``--enable``
switches CPU mode on here, prints, then off, and checks that every patched attribute holds its
original object again (a CPU mode already on is listed and left on)."""

from __future__ import annotations

import json
import sys

from .args import Command, not_restored, print_by_part, snapshot

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
    cuda, restored, path = torch.cuda.is_available(), None, args.megatron_lm
    if args.enable and not cuda and not cpu.active():  # never switch off a CPU mode we did not start
        if path:
            sys.path.insert(0, path)
            from ..megatron_lm import triton_stub

            triton_stub.preimport_triton_users()
        saved = snapshot([r for p in cpu.PARTS if path or p == "megatron-core" for r in cpu.redirections(p)])
        cpu.enable(megatron_lm=bool(path))
        rows = cpu.status()
        cpu.disable()
        restored = not_restored(saved)
    else:
        rows = cpu.status()
    if args.json:
        print(json.dumps({"cuda_available": cuda, "restore_mismatches": restored, "redirections": [
            {"part": part, "target": r.target, "state": state, "why": r.why} for part, r, state in rows]},
            indent=1))
    else:
        print("CUDA is available here: CPU mode is never active on this machine." if cuda else
              "No CUDA here: CPU mode switches on by itself where megatron_dualpipe runs Megatron "
              "(tests, demo, pretrain_gpt.py through the launcher or the patch).")
        print_by_part(rows, "redirections", lambda r, state: (f"  {state:10s} {r.target}", r.why), restored, "disable")
    return 1 if restored else 0


COMMAND = Command("cpu-mode", HELP, configure, run)

"""``megatron-dualpipe patch``: add (or remove) the hook in a Megatron-LM checkout's pretrain_gpt.py."""
from __future__ import annotations

from .args import Command


def configure(p) -> None:
    p.add_argument("path", help="root of a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.0")
    p.add_argument("--check", action="store_true", help="say what would change, change nothing")
    p.add_argument("--revert", action="store_true", help="remove the hook")


def run(args) -> int:
    from ..megatron_lm.patching import apply

    print(apply(args.path, revert=args.revert, check=args.check))  # a PatchError is a ValueError: one line
    return 0


COMMAND = Command("patch", "add the 3-line megatron-dualpipe hook to Megatron-LM's pretrain_gpt.py (or --revert it)",
                  configure, run)

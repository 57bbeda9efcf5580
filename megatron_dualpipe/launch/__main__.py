"""``python -m megatron_dualpipe.launch`` and ``torchrun ... -m megatron_dualpipe.launch``: :mod:`.launcher`.
With ``--check`` (the launch script's preflight) an interruption ends in one line."""
import sys

from .launcher import main

if __name__ == "__main__":
    if "--check" in sys.argv[1:3]:
        from . import interrupts

        sys.exit(interrupts.guarded(main, "megatron_dualpipe.launch"))
    sys.exit(main())

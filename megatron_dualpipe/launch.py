"""Run a Megatron-LM training script with megatron-dualpipe installed.

Usage::

    torchrun --nproc-per-node 4 -m megatron_dualpipe.launch /path/to/Megatron-LM/pretrain_gpt.py \\
        --pipeline-model-parallel-size 4 --pipeline-schedule dualpipe ...

The script runs unmodified: this module puts the script's directory (the Megatron-LM checkout)
first on ``sys.path`` -- exactly where ``python pretrain_gpt.py`` would put it, so
``megatron.*`` resolves to that checkout rather than to an installed ``megatron-core`` wheel --,
calls :func:`megatron_dualpipe.megatron_lm.install.install` (argument extension, environment
fixes, and CPU-mode redirections when no GPU is present), then executes the script with
``runpy.run_path(..., run_name="__main__")`` and the remaining command-line arguments.
"""

import os
import runpy
import sys

USAGE = "usage: python -m megatron_dualpipe.launch /path/to/Megatron-LM/pretrain_gpt.py [ARGS...]"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(USAGE, file=sys.stderr)
        return 2
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"{USAGE}\nno such script: {argv[0]}", file=sys.stderr)
        return 2
    script_dir = os.path.dirname(script)
    if script_dir in sys.path:
        sys.path.remove(script_dir)
    sys.path.insert(0, script_dir)
    sys.argv = [script] + argv[1:]

    from megatron_dualpipe.megatron_lm.install import install

    install()
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

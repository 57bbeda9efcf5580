"""Run a Megatron-LM training script with megatron-dualpipe installed.

Usage::

    torchrun --nproc-per-node 4 -m megatron_dualpipe.launch /path/to/Megatron-LM/pretrain_gpt.py \\
        --pipeline-model-parallel-size 4 --pipeline-schedule dualpipe ...

    python -m megatron_dualpipe.launch --check /path/to/Megatron-LM/pretrain_gpt.py   # preflight only

The script runs unmodified: this module puts the script's directory (the Megatron-LM checkout)
first on ``sys.path`` -- exactly where ``python pretrain_gpt.py`` would put it, so
``megatron.*`` resolves to that checkout rather than to an installed ``megatron-core`` wheel --,
calls :func:`megatron_dualpipe.megatron_lm.install.install` (argument extension, environment
fixes, and CPU-mode redirections when no GPU is present), then executes the script with
``runpy.run_path(..., run_name="__main__")`` and the remaining command-line arguments.

Before any of that, a preflight refuses (one line, exit status 2) what would fail later: a
missing script, a checkout that is not one of the Megatron-LM tags the plugin's hooks are
written for (``megatron_dualpipe.versions.TAGS``: core_v0.16.1, core_v0.19.0;
``MEGATRON_DUALPIPE_SKIP_VERSION_CHECK=1`` tries anyway), and missing training dependencies
(named, with the pip command).
"""

import os
import runpy
import sys

USAGE = "usage: python -m megatron_dualpipe.launch [--check] /path/to/Megatron-LM/pretrain_gpt.py [ARGS...]"
SKIP_VERSION = "MEGATRON_DUALPIPE_SKIP_VERSION_CHECK"  # = versions.SKIP_ENV


def preflight(script):
    """Why ``script`` cannot run with the plugin (one line naming the fix), or None."""
    from megatron_dualpipe.megatron_lm import patching, requirements

    if not os.path.isfile(script):
        return f"no such script: {script}"
    root = os.path.dirname(os.path.abspath(script))
    if os.environ.get(SKIP_VERSION) != "1":
        problem = patching.tag_problem(root, patching.core_version(root))
        if problem:
            return f"{problem}, or set {SKIP_VERSION}=1 to try anyway"
    return requirements.problem()


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    check = bool(argv) and argv[0] == "--check"
    if check:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(USAGE, file=sys.stderr)
        return 2
    script = os.path.abspath(argv[0])
    problem = preflight(script)
    if problem:
        print(f"megatron_dualpipe.launch: error: {problem}", file=sys.stderr)
        return 2
    if check:
        print(f"megatron_dualpipe.launch: {script} can run with megatron-dualpipe")
        return 0
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

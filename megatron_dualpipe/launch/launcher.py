"""Run a Megatron-LM training script, unmodified, with megatron-dualpipe installed::

    torchrun --nproc-per-node 4 -m megatron_dualpipe.launch /path/to/Megatron-LM/pretrain_gpt.py ...

Its directory goes first on ``sys.path`` (so ``megatron.*`` is the checkout's, not a wheel's). A
preflight (``--check``: only that) refuses in one line each what would fail later on every rank; a
refusal raised under torchrun (:func:`.validation.is_refusal`) is said once, without a traceback.
"""

import os
import runpy
import sys
import time

from .. import versions
from ..megatron_lm import patching, requirements
from . import checks, placement, validation

USAGE = ("usage: python -m megatron_dualpipe.launch [--check] [--pair-placement] /path/to/Megatron-LM/pretrain_gpt.py "
         "[ARGS...]")
#: How long a rank that does not say the refusal waits to exit (torchrun stops every rank at the first).
REFUSAL_WAIT_S = 3.0
#: The counter in torch.distributed's store that names the first rank to refuse.
REFUSAL_KEY = "megatron_dualpipe/refusal"
HELP = ("Runs a Megatron-LM training script (pretrain_gpt.py) with megatron-dualpipe installed, so that it takes\n"
        "--pipeline-schedule dualpipe|dualpipev; under torchrun: torchrun --nproc-per-node 8 -m megatron_dualpipe.launch\n"
        "PATH/pretrain_gpt.py ARGS...\n"
        "  --check           check the checkout, the training dependencies, torch and ARGS (tokenizer, data), then exit\n"
        "  --pair-placement  dualpipe: put pipeline ranks i and pp-1-i on the same node\n"
        "The script's own options: PATH/pretrain_gpt.py --help (through this launcher, with the DualPipe flags).")


def preflight(script):
    """Why ``script`` cannot run with the plugin (one line naming the fix), or None."""
    if not os.path.isfile(script):
        return f"no such script: {script}"
    root = os.path.dirname(os.path.abspath(script))
    if not versions.skipped() and (problem := patching.tag_problem(root, versions.checkout_core_version(root))):
        return f"{problem}, or set {versions.SKIP_ENV}=1 to try anyway"
    return requirements.problem()


def argument_problems(script, argv, check: bool):
    """The problems :mod:`.checks` finds; under torchrun only rank 0 reads the data's token ids."""
    found = [checks.torch_problem()] if check else []
    if argv if check else os.path.basename(script) == "pretrain_gpt.py":
        found += checks.argument_problems(argv, scan=check or os.environ.get("RANK", "0") == "0")
    return [p for p in found if p]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    options = set()
    while argv and argv[0] in ("--check", placement.FLAG):
        options.add(argv.pop(0))
    check, paired = "--check" in options, placement.FLAG in options
    if argv in (["-h"], ["--help"]):  # asked for: the usage on stdout, and success
        print(f"{USAGE}\n\n{HELP}")
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    script = os.path.abspath(argv[0])
    problem = preflight(script)
    found = [problem] if problem else []
    wants_help = any(a in ("-h", "--help") for a in argv[1:])
    if os.path.isfile(script) and (check or not problem) and not wants_help:
        found += argument_problems(script, argv[1:], check)
    if paired and not wants_help:
        found += [p for p in [placement.problem(argv[1:], os.environ)] if p]
    layout = note = None
    if check and not found and not wants_help:
        refused, layout, note = validation.check(script, argv[1:])
        found += refused
    for line in found:
        print(f"megatron_dualpipe.launch: error: {line}", file=sys.stderr)
    if found:
        return 2
    if check:
        if layout:
            print(f"layout: {layout}")
        if note:
            print(f"megatron_dualpipe.launch: note: {note}")
        with_args = " with these arguments" if argv[1:] else ""
        print(f"megatron_dualpipe.launch: {script} can run with megatron-dualpipe{with_args} "
              f"(Python {sys.executable})")
        return 0
    script_dir = os.path.dirname(script)
    if script_dir in sys.path:
        sys.path.remove(script_dir)
    sys.path.insert(0, script_dir)
    sys.argv = [script] + argv[1:]
    if paired:
        placement.apply_from_launcher(argv[1:])  # before Megatron reads RANK

    from ..megatron_lm.install import install

    install()
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as e:  # noqa: BLE001 - a refusal is said once; anything else keeps its traceback
        if not validation.is_refusal(e):
            raise
        return say_refusal(e)
    return 0


def first_to_refuse() -> bool:
    """Whether this rank says the job's refusal: the first to count itself in torch.distributed's
    store once the process group is up (a checkpoint some ranks refuse); before that, rank 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return os.environ.get("RANK", "0") == "0"
    key = f"{REFUSAL_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        return dist.distributed_c10d._get_default_store().add(key, 1) == 1
    except Exception:  # noqa: BLE001 - the store's host is gone: the rank that ended first said why
        return False


def say_refusal(error) -> int:
    """One line per problem of a refusal, said by one rank, no traceback; exit status 2."""
    if first_to_refuse():
        for line in validation.explain(error):
            print(f"megatron_dualpipe.launch: error: {line}", file=sys.stderr, flush=True)
    else:  # torchrun's agent stops every rank at the first exit: the rank that says why has said it by then
        time.sleep(REFUSAL_WAIT_S)
    return 2


"""Run a Megatron-LM training script with megatron-dualpipe installed.

Usage::

    torchrun --nproc-per-node 4 -m megatron_dualpipe.launch /path/to/Megatron-LM/pretrain_gpt.py \\
        --pipeline-model-parallel-size 4 --pipeline-schedule dualpipe ...

    python -m megatron_dualpipe.launch --check /path/to/Megatron-LM/pretrain_gpt.py   # preflight only
    torchrun ... -m megatron_dualpipe.launch --pair-placement /path/to/Megatron-LM/pretrain_gpt.py ...

The script runs unmodified: this module puts the script's directory (the Megatron-LM checkout)
first on ``sys.path`` -- exactly where ``python pretrain_gpt.py`` would put it, so
``megatron.*`` resolves to that checkout rather than to an installed ``megatron-core`` wheel --,
calls :func:`megatron_dualpipe.megatron_lm.install.install` (argument extension, environment
fixes, and CPU-mode redirections when no GPU is present), then executes the script with
``runpy.run_path(..., run_name="__main__")`` and the remaining command-line arguments.

Before any of that, a preflight refuses (one line per problem, exit status 2) what would fail
later: a missing script, a checkout that is not one of the Megatron-LM tags the plugin's hooks are
written for (``megatron_dualpipe.versions.TAGS``: core_v0.16.1, core_v0.19.0;
``MEGATRON_DUALPIPE_SKIP_VERSION_CHECK=1`` tries anyway), missing training dependencies (named,
with the pip command), and with ``--check`` the script's arguments as well
(:mod:`.checks`: torch and torchrun importable here, the tokenizer, the
data prefixes and the data's token ids against the vocabulary), then Megatron-LM's own
``parse_args`` / ``validate_args`` and the plugin's checks on the whole argument list, in this one
process (:mod:`.validation`; world size from ``WORLD_SIZE``).
``scripts/pretrain_gpt_dualpipe.sh`` runs ``--check`` with the arguments it is about to pass.
Under torchrun, a refusal of the arguments (a
:class:`~megatron_dualpipe.megatron_lm.arguments.DualPipeArgumentError`, or an assertion of
Megatron-LM's ``validate_args``: every rank refuses the same arguments) is printed by rank 0 only,
one line per problem, no traceback, exit status 2; so is a checkpoint the schedule cannot load (a
:class:`~megatron_dualpipe.megatron_lm.refusal.Refusal`), by the first rank that refuses it.

``--pair-placement`` (:mod:`.placement`): each process takes the Megatron
global rank that puts pipeline ranks i and pp-1-i on the same node (``RANK`` rewritten before the
script runs, ``LOCAL_RANK`` kept); with ``--check`` it checks that this can be done for torchrun's
``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` as set in the environment.
"""

import os
import runpy
import sys
import time

USAGE = ("usage: python -m megatron_dualpipe.launch [--check] [--pair-placement] /path/to/Megatron-LM/pretrain_gpt.py "
         "[ARGS...]")
PAIR_PLACEMENT = "--pair-placement"  # = placement.FLAG
SKIP_VERSION = "MEGATRON_DUALPIPE_SKIP_VERSION_CHECK"  # = versions.SKIP_ENV
#: How long a rank that does not say the refusal waits before it exits: the launcher (torchrun's
#: agent) stops every rank at the first exit, and the rank that says it (rank 0 for refused arguments,
#: the first to refuse a checkpoint) prints it first.
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
    from ..megatron_lm import patching, requirements

    if not os.path.isfile(script):
        return f"no such script: {script}"
    root = os.path.dirname(os.path.abspath(script))
    if os.environ.get(SKIP_VERSION) != "1":
        problem = patching.tag_problem(root, patching.core_version(root))
        if problem:
            return f"{problem}, or set {SKIP_VERSION}=1 to try anyway"
    return requirements.problem()


def argument_problems(script, argv, check: bool):
    """The problems :mod:`.checks` finds: with ``--check``, torch and torchrun here; for
    ``pretrain_gpt.py`` (and any script with ``--check`` and arguments) its tokenizer and data
    arguments. Under torchrun every rank checks the arguments, but only rank 0 reads the data's
    token ids."""
    from . import checks

    found = []
    if check:
        found += [p for p in [checks.torch_problem()] if p]
    if (check and argv) or os.path.basename(script) == "pretrain_gpt.py" and not check:
        found += checks.argument_problems(argv, scan=check or os.environ.get("RANK", "0") == "0")
    return found


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    options = set()
    while argv and argv[0] in ("--check", PAIR_PLACEMENT):
        options.add(argv.pop(0))
    check, paired = "--check" in options, PAIR_PLACEMENT in options
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
        from . import placement

        found += [p for p in [placement.problem(argv[1:], os.environ)] if p]
    layout = note = None
    if check and not found and not wants_help:
        from . import validation

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
        from . import placement

        placement.apply_from_launcher(argv[1:])  # before Megatron reads RANK

    from ..megatron_lm.install import install

    install()
    from . import validation

    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as e:  # noqa: BLE001 - a refusal is said once; anything else keeps its traceback
        if not validation.is_refusal(e):
            raise
        return say_refusal(e)
    return 0


def first_to_refuse() -> bool:
    """Whether this rank is the one that says the job's refusal: the first to count itself in
    torch.distributed's store (which every rank of every node reaches) once the process group is up
    (a checkpoint refused at load, by some ranks or all); before that (the arguments, refused alike
    by every rank), rank 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return os.environ.get("RANK", "0") == "0"
    key = f"{REFUSAL_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        return dist.distributed_c10d._get_default_store().add(key, 1) == 1
    except Exception:  # noqa: BLE001 - the store's host is gone: the rank that ended first said why
        return False


def say_refusal(error) -> int:
    """One line per problem of a refusal (:func:`.validation.is_refusal`), said by one rank
    (:func:`first_to_refuse`), no traceback; exit status 2."""
    from . import validation

    if first_to_refuse():
        for line in validation.explain(error):
            print(f"megatron_dualpipe.launch: error: {line}", file=sys.stderr, flush=True)
    else:  # torchrun's agent stops every rank at the first exit: the rank that says why has said it by then
        time.sleep(REFUSAL_WAIT_S)
    return 2


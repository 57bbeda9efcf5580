"""Megatron-LM's argument validation and the plugin's, run once before ``torchrun`` starts instead of
refused on every rank, one traceback each: ``parse_args`` and ``validate_args`` (wrapped by the
``megatron-lm arguments`` hooks) in this process, without ``torch.distributed``. A checkout without
``megatron/training/arguments.py`` (the launch script tests' stand-in) is not checked.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import traceback
from typing import List, Optional, Sequence, Tuple

from ..schedule import registry

#: ``pretrain_gpt.py``'s ``args_defaults`` (core_v0.16.1 and core_v0.19.0).
PRETRAIN_GPT_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
ARGUMENTS_FILE = os.path.join("megatron", "training", "arguments.py")


@contextlib.contextmanager
def _silenced():
    """stdout and stderr (the file descriptors: Megatron prints, warns and logs) to /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved, null = [os.dup(1), os.dup(2)], os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
        with contextlib.redirect_stdout(open(os.devnull, "w")), contextlib.redirect_stderr(open(os.devnull, "w")):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)


def _install(root: str) -> None:
    """What a rank installs before Megatron parses its arguments."""
    if root in sys.path:
        sys.path.remove(root)
    sys.path.insert(0, root)
    from .. import cpu, hooks
    from ..megatron_lm import triton_stub

    triton_stub.preimport_triton_users()
    hooks.install(["python", "megatron-lm arguments"])
    cpu.enable(megatron_lm=True)


def fewest_gpus(args) -> int:
    """The smallest world size Megatron accepts for ``args``' parallel sizes."""
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    return math.lcm(tp * pp * args.context_parallel_size, etp * args.expert_model_parallel_size * pp)


def _parse_and_validate(script: str, argv: Sequence[str]):
    from megatron.training import arguments

    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        args = arguments.parse_args()
    finally:
        sys.argv = saved
    if "WORLD_SIZE" not in os.environ:
        args.world_size = fewest_gpus(args)
    if args.yaml_cfg is not None:
        from megatron.training.yaml_arguments import validate_yaml

        validate_yaml(args, dict(PRETRAIN_GPT_DEFAULTS))
    else:
        arguments.validate_args(args, dict(PRETRAIN_GPT_DEFAULTS))
    return args


def explain(error: BaseException, parser_output: str = "") -> List[str]:
    """One line per problem in ``error`` (what a rank would have raised)."""
    from ..megatron_lm.arguments import DualPipeArgumentError
    from ..megatron_lm.refusal import Refusal

    if isinstance(error, DualPipeArgumentError):  # its problems, one line each
        lines = [line.strip() for line in str(error).splitlines()]
        return [line[2:] for line in lines if line.startswith("- ")] or [" ".join(lines)]
    if isinstance(error, Refusal):
        return [" ".join(str(error).split())]
    if isinstance(error, SystemExit):  # argparse: usage and "error: ..." went to stderr
        said = [line.split("error: ", 1)[1] for line in parser_output.splitlines() if "error: " in line]
        return [f"Megatron-LM's parser: {said[-1] if said else 'exit status ' + str(error.code)}"]
    frame = traceback.extract_tb(error.__traceback__)[-1]
    where = f"{os.path.basename(os.path.dirname(frame.filename))}/{os.path.basename(frame.filename)}:{frame.lineno}"
    text = " ".join(str(error).split()) or (frame.line or "").strip()
    kind = "" if isinstance(error, AssertionError) else f"{type(error).__name__}: "
    return [f"Megatron-LM refuses these arguments ({where}): {kind}{text}"]


def is_refusal(error: BaseException) -> bool:
    """Whether ``error`` refuses the arguments alike on every rank: the plugin's refusals, or an
    assertion of ``validate_args`` / ``validate_yaml`` itself (one elsewhere keeps its traceback)."""
    from ..megatron_lm.arguments import DualPipeArgumentError
    from ..megatron_lm.refusal import Refusal

    if isinstance(error, (DualPipeArgumentError, Refusal)):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    in_training = [f for f in frames if "megatron/training/" in f.filename.replace(os.sep, "/")]
    return (isinstance(error, AssertionError) and bool(frames) and frames[-1] in in_training
            and any(f.name in ("validate_args", "validate_yaml") for f in in_training))


def layout(args) -> str:
    """The run the validated ``args`` describe, as the launch script's header says it."""
    dp = args.data_parallel_size
    m = args.global_batch_size // (args.micro_batch_size * dp)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    return (f"{getattr(args, 'pipeline_schedule', registry.DEFAULT)}{f' (interleaved, {vpp} chunks per rank)' if vpp else ''}: "
            f"{args.world_size} processes (minimum {fewest_gpus(args)}), PP={args.pipeline_model_parallel_size} "
            f"TP={args.tensor_model_parallel_size} EP={args.expert_model_parallel_size} "
            f"CP={args.context_parallel_size} DP={dp}, {m} micro-batches per iteration")


def needs_a_gpu_here(error: BaseException) -> bool:
    """Whether ``error`` is Megatron asking a GPU this machine lacks: not a refusal of the arguments."""
    frames = traceback.extract_tb(error.__traceback__)
    if not any("/torch/cuda/" in f.filename.replace(os.sep, "/") for f in frames):
        return False
    import torch

    return not torch.cuda.is_available()


def check(script: str, argv: Sequence[str]) -> Tuple[List[str], Optional[str], Optional[str]]:
    """(what Megatron and the plugin refuse, one line each; the :func:`layout` of accepted arguments;
    why the validation could not run here, when it could not)."""
    root = os.path.dirname(os.path.abspath(script))
    if not os.path.isfile(os.path.join(root, ARGUMENTS_FILE)):
        return [], None, None
    try:
        with _silenced():
            _install(root)
    except Exception as e:  # noqa: BLE001 - whatever the import raised, in one line
        return [f"cannot import Megatron-LM's argument parser from {root} ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:300]}): run the check with the Python of the training "
                f"environment"], None, None
    with tempfile.TemporaryFile("w+") as said:
        try:
            with _silenced(), contextlib.redirect_stderr(said):
                args = _parse_and_validate(script, argv)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - each is a refusal a rank would raise
            if needs_a_gpu_here(e):
                return [], None, (f"Megatron-LM's validate_args asks the GPU about these arguments "
                                  f"({explain(e)[0].split(': ', 1)[-1]}) and this machine has none: "
                                  f"they are checked by the ranks on the GPU nodes")
            said.seek(0)
            return explain(e, said.read()), None, None
    return [], layout(args), None

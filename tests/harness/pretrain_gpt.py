"""Run Megatron-LM's own ``pretrain_gpt.py`` through ``megatron_dualpipe.launch`` on local gloo
processes and read back what Megatron logs per iteration.

Needs a Megatron-LM checkout at tag ``core_v0.16.1`` in ``MEGATRON_LM_PATH`` and the Python
packages its training code imports; :func:`skip_unless_available` says what is missing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_PATH")
SKIP_MESSAGE = "set MEGATRON_LM_PATH to a Megatron-LM checkout at tag core_v0.16.1 (pretrain_gpt.py runs)"
_DEPENDENCIES = {"six": "six", "regex": "regex", "yaml": "pyyaml", "pydantic": "pydantic", "pybind11": "pybind11"}

#: A tiny GPT on mock data with dropout off (the micro-batch order cannot change dropout masks),
#: fp32, gloo, constant learning rate: add the parallel sizes and the iterations.
TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--distributed-backend", "gloo", "--use-cpu-initialization",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant", "--seed", "1234",
    "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
_LOSS = re.compile(r"lm loss: ([0-9.E+-]+|nan|inf)")
_GRAD_NORM = re.compile(r"grad norm: ([0-9.E+-]+|nan|inf)")


def skip_unless_available() -> None:
    """pytest.skip with the reason when pretrain_gpt.py cannot run here."""
    if not MEGATRON_LM_PATH or not os.path.isfile(os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py")):
        pytest.skip(SKIP_MESSAGE)
    missing = [pkg for mod, pkg in _DEPENDENCIES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        pytest.skip(f"Megatron-LM's training code needs: pip install {' '.join(missing)}")


@dataclass
class Run:
    """What one ``pretrain_gpt.py`` run logged: per-iteration ``lm loss`` and ``grad norm``."""

    losses: Dict[int, float] = field(default_factory=dict)
    grad_norms: Dict[int, float] = field(default_factory=dict)
    output: str = ""


def parse_iterations(output: str) -> Run:
    run = Run(output=output)
    for iteration, rest in _ITERATION.findall(output):
        loss, norm = _LOSS.search(rest), _GRAD_NORM.search(rest)
        if loss:
            run.losses[int(iteration)] = float(loss.group(1))
        if norm:
            run.grad_norms[int(iteration)] = float(norm.group(1))
    return run


def run_pretrain_gpt(nproc: int, args: Sequence[str], *, label: str = "", timeout: float = 600) -> Run:
    """``torchrun --nproc-per-node nproc -m megatron_dualpipe.launch pretrain_gpt.py ARGS``.

    Fails the test with the output's tail if the run fails or logs no loss; prints the losses.
    """
    skip_unless_available()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megatron_dualpipe.launch", os.path.join(MEGATRON_LM_PATH, "pretrain_gpt.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    what = label or " ".join(args)
    assert proc.returncode == 0, f"{what} failed:\n{output[-6000:]}"
    run = parse_iterations(output)
    assert run.losses, f"{what}: no 'lm loss' lines in the output:\n{output[-3000:]}"
    print(f"\n{what}: lm loss " + ", ".join(f"{i}: {v:.6f}" for i, v in sorted(run.losses.items()))
          + " | grad norm " + ", ".join(f"{i}: {v:.3f}" for i, v in sorted(run.grad_norms.items())))
    return run


def max_relative_difference(got: Dict[int, float], want: Dict[int, float], iterations: List[int]) -> float:
    """max over ``iterations`` of |got - want| / |want| (both must log every iteration)."""
    assert all(i in got and i in want for i in iterations), (iterations, got, want)
    return max(abs(got[i] - want[i]) / abs(want[i]) for i in iterations)

"""The selftest's settings, checked before any process starts (one line naming the fix)."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Optional

from .. import versions
from ..proof.models import ModelSpec, deepseek_v3
from .watchdog import LIMIT_PER_DEADLINE, SETUP_LIMIT_S

#: Relative tolerance of losses and gradients (largest |difference| over the largest |value| of each
#: tensor) per dtype. fp32: the schedules add the same numbers in other orders (DualPipe sums the two
#: copies of a stage); bf16 rounds every product to 8 bits of mantissa; FP8 (tensorwise: each GEMM's
#: inputs scaled by their own amax) rounds them to 3 or 2 bits. Not measured on a GPU yet.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp8": 1e-1}


@dataclasses.dataclass(frozen=True)
class SelftestConfig:
    world: int
    tp: int = 1
    ep: int = 1
    te: bool = False
    fp8: bool = False
    out: str = "selftest-out"
    quick: bool = False
    deadline_s: float = 60.0  # every P2P wait, and the no-hang stage's bound
    gpu: bool = False
    command: str = "megatron-dualpipe selftest"
    # the user's model, for the speed stage's matrix-multiply stages (GPU)
    model_hidden: int = 4096
    model_seq: int = 2048
    model_layers_per_stage: int = 2

    @property
    def stage_limit_s(self) -> float:
        """The longest any phase of a stage may take on a rank (:mod:`.watchdog`)."""
        return LIMIT_PER_DEADLINE * self.deadline_s

    @property
    def collective_timeout_s(self) -> float:
        """The process group's timeout: past the stage and set-up limits, so that a stuck rank's
        watchdog speaks (with its stack) before a collective elsewhere times out without saying why."""
        return max(self.stage_limit_s, SETUP_LIMIT_S) + 60.0

    @property
    def pp(self) -> int:
        return self.world // (self.tp * self.ep)

    @property
    def dtype_key(self) -> str:
        if not self.gpu:  # the CPU mode: fp32, and FP8 (the stand-in's) a no-op for the numbers
            return "fp32"
        return "fp8" if self.fp8 else ("bf16" if self.te else "fp32")

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype_key]

    def tolerance_of(self, spec: ModelSpec) -> float:
        """One model's tolerance: the TE matrix's dtypes differ from the run's; FP8 quantises only on a GPU."""
        if spec.dtype == "fp32":
            return TOLERANCE["fp32"]
        return TOLERANCE["fp8" if spec.fp8 and self.gpu else "bf16"]

    def spec(self, moe: bool = False) -> ModelSpec:
        """The tiny model: two layers per DualPipe stage (one per DualPipeV chunk)."""
        hidden = 64 if self.gpu else 32
        return ModelSpec(layers=2 * self.pp, hidden=hidden, heads=4, seq=32 if self.gpu else 16, mbs=2,
                         vocab=128 if self.gpu else 64, dtype="bf16" if self.dtype_key != "fp32" else "fp32",
                         layer_spec="te" if self.te else "local", experts=2 * self.ep if moe else None,
                         combined_step=moe and self.ep > 1, fp8=self.fp8)

    def spec_v3(self) -> ModelSpec:
        """The tiny DeepSeek-V3-shaped model: 2 experts per expert-parallel rank, at least 4 (2 groups of 2)."""
        return deepseek_v3(dataclasses.replace(self.spec(moe=True), experts=2 * max(self.ep, 2)))


def check(world: int, tp: int, ep: int, te: bool, fp8: bool, gpu: bool, gpus_here: int,
          torchrun: bool) -> Optional[str]:
    """What is wrong with these settings (None: nothing), saying what would work."""
    if world < 2:
        return f"the selftest needs at least 2 processes (a pipeline), got {world}"
    for name, v in (("--tp", tp), ("--ep", ep)):
        if v < 1:
            return f"{name} must be >= 1, got {v}"
    if world % (tp * ep):
        return f"{world} processes do not split into tp={tp} x ep={ep} x pp: use a multiple of {tp * ep}"
    pp = world // (tp * ep)
    if pp < 2 or pp % 2:
        good = tp * ep * max(2, pp + pp % 2)
        return (f"DualPipe needs an even pipeline of at least 2 stages; {world} processes with tp={tp} ep={ep} "
                f"give pp={pp}: use --nproc {good}")
    if fp8 and not te:
        return "--fp8 runs Transformer Engine's FP8 layers: add --te"
    if te and not gpu:  # the CPU mode's Transformer Engine stand-in runs the layers, FP8 as a no-op
        from ..cpu import stand_ins

        if stand_ins.real_library("transformer_engine"):
            return ("--te without a GPU runs the CPU mode's Transformer Engine stand-in, which never shadows the "
                    "transformer-engine installed here (it needs a GPU): leave out --te/--fp8")
    elif te:
        try:
            if importlib.util.find_spec("transformer_engine") is None:
                return "--te: transformer-engine is not installed: pip install transformer-engine[pytorch]"
        except (ImportError, ValueError):
            return "--te: transformer-engine cannot be imported"
    if gpu and (problem := _gpu_count_problem(world, tp * ep, gpus_here, torchrun)):
        return problem
    problem = versions.torch_problem()
    return f"the selftest runs DualPipe, which {problem}" if problem else None


def _gpu_count_problem(world: int, unit: int, gpus_here: int, torchrun: bool) -> Optional[str]:
    """One rank per GPU (NCCL refuses two ranks on one device): the ranks started on this machine
    against its GPUs, naming the largest count that works (an even pipeline of tp x ep groups)."""
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else world
    if here <= gpus_here:
        return None
    if torchrun:
        return (f"torchrun starts {here} ranks on this node, which has {gpus_here} GPU(s) (one rank per GPU): "
                f"use --nproc-per-node {gpus_here}")
    fits = gpus_here // (2 * unit) * (2 * unit)
    fix = (f"use --nproc {fits}, or torchrun across nodes" if fits else
           f"the smallest selftest needs {2 * unit} (pp=2 x tp x ep): run it on a machine with more GPUs, or "
           f"across nodes with torchrun")
    return f"{world} ranks need {world} GPUs on this machine (one rank per GPU), found {gpus_here}: {fix}"


def default_world(gpu: bool, gpus_here: int) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return gpus_here - gpus_here % 2 if gpu and gpus_here >= 2 else 4  # an even pipeline

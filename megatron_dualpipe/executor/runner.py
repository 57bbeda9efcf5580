"""Interpret one rank's schedule: the actions, in order, with the planned batches of P2P.

The runner knows nothing about Megatron: a :class:`StageCompute` says what a forward, a
backward, a deferred weight gradient and a fused F&B unit are for this rank's model chunks.
Nor does it re-derive the pipeline's rule: the communication plan says which tensor each action
takes and hands on, and from or to which rank. The runner owns the tensors in flight: receive
buffers, outputs waiting to be sent, and the local hand-over at the turn of DualPipeV's "V"
(stage pp-1 to stage pp on the last rank).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ..schedule import F, W, Action, build_schedule
from ..schedule.comm import Label, RankPlan, plan
from ..schedule.registry import Schedule
from .p2p import P2P
from .trace import TraceRecorder, trace_from_env


class StageCompute(Protocol):
    def is_fake(self, a: Action) -> bool:
        """A padding micro-batch: the runner passes zeros of the right shape, no compute."""

    def forward(self, a: Action, input_tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Run F; return the tensor for the next stage (ignored at the loss stage)."""

    def backward(self, a: Action, output_grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Run B (weight gradient deferred to W) or BW; return the input gradient."""

    def weight(self, a: Action) -> None:
        """Run the deferred weight gradient of an earlier B."""

    def release(self, a: Action, output: torch.Tensor) -> None:
        """The output of ``a`` has been sent: its storage may be freed (keep the autograd node)."""

    def forward_backward(self, f_action: Action, b_action: Action, input_tensor: Optional[torch.Tensor],
                         output_grad: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Run a fused F&B unit (``f_action`` has ``overlap=True``, ``b_action`` is the backward
        after it); return (F's output, B's input gradient)."""


class StageComputeBase:
    """Defaults a :class:`StageCompute` can inherit. A compute that can overlap one
    micro-batch's forward with another's backward (DeepSeek's ``overlapped_forward_backward``)
    overrides :meth:`forward_backward`; the runner never knows how a unit overlaps."""

    def forward_backward(self, f_action: Action, b_action: Action, input_tensor: Optional[torch.Tensor],
                         output_grad: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The fused unit without overlap: the forward, then the backward."""
        output = self.forward(f_action, input_tensor)
        return output, self.backward(b_action, output_grad)


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and device of every tensor passed between stages (activations and grads)."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class Program:
    schedule: Schedule
    actions: Tuple[Tuple[Action, ...], ...]
    plans: Tuple[RankPlan, ...]


@functools.lru_cache(maxsize=64)
def compile_program(name: str, pp: int, microbatches: int, forward_only: bool) -> Program:
    """Build and check the schedule and its communication plan (cached: pure and reused
    every iteration). ``forward_only`` keeps just the forwards, in the same order."""
    sched = build_schedule(name, pp, microbatches)
    acts = tuple(tuple(dataclasses.replace(a, overlap=False) for a in r if a.op == F) if forward_only else r
                 for r in sched.ranks)
    return Program(sched, acts, tuple(plan(sched.layout, acts)))


def check_sendable(rank: int, a: Action, what: str, t: torch.Tensor, spec: TensorSpec) -> None:
    """Every tensor passed between stages must have ``spec``'s shape and dtype: the receiver's
    buffer is allocated from ``spec`` (gloo silently accepts a smaller message, leaving the tail of
    the buffer uninitialised, and aborts the receiving process on a larger one)."""
    if tuple(t.shape) == tuple(spec.shape) and t.dtype == spec.dtype:
        return
    if tuple(t.shape) != tuple(spec.shape):
        fix = ("all micro-batches must have seq_length x micro_batch_size; set --seq-length/--micro-batch-size "
               "or pad the data")
    else:
        fix = "set config.pipeline_dtype (--bf16/--fp16) to the dtype the model computes in"
    op = "forward" if a.op == F else "backward"
    raise ValueError(f"pipeline rank {rank}: action {a} ({op} of micro-batch {a.mb} of direction {a.dir} at stage "
                     f"{a.stage}) produced {what} of shape {tuple(t.shape)} and dtype {t.dtype}, "
                     f"but the pipeline passes tensors of shape {tuple(spec.shape)} and dtype {spec.dtype} "
                     f"(seq_length x micro_batch_size x hidden): {fix}")


@dataclass
class RunStats:
    """Cheap figures of one ``run_rank`` call."""

    peak_in_flight: int = 0  # most receive buffers and unfinished sends held at once


def run_rank(program: Program, rank: int, compute: StageCompute, p2p: P2P, spec: TensorSpec,
             trace: Optional[TraceRecorder] = None) -> RunStats:
    """Run this rank's actions; raises on timeout naming the action that waited.

    Each planned batch is posted, not waited; a receive is waited right before the action that
    consumes it, and the sends complete in the background (see :mod:`.p2p`). ``trace`` (or the
    ``MEGATRON_DUALPIPE_TRACE`` directory) records when each action ran.
    """
    acts = program.actions[rank]
    rp = program.plans[rank]
    local: Dict[Label, torch.Tensor] = {}
    outbox: Dict[Label, Tuple[Action, torch.Tensor]] = {}
    unreleased: Dict[Tuple[int, int, int], Label] = {}  # forward (dir, mb, stage) -> its output's send
    batches = rp.batches
    bi = 0
    recorder = trace if trace is not None else trace_from_env()
    recording = recorder.begin(program, rank, p2p.global_ranks) if recorder is not None else None

    def post(upto_unit: int, where: str) -> None:
        nonlocal bi
        while bi < len(batches) and batches[bi].unit <= upto_unit:
            b = batches[bi]
            sends = []
            for t in b.sends:
                a, out = outbox.pop(t.label)
                release = None
                if a.op == F and not compute.is_fake(a):
                    release = functools.partial(compute.release, a, out)
                    unreleased[(a.dir, a.mb, a.stage)] = t.label
                sends.append((t.peer, out, t.label, release))
            recvs = [(t.peer, torch.empty(spec.shape, dtype=spec.dtype, device=spec.device,
                                          requires_grad=t.label[0] == "act"), t.label) for t in b.recvs]
            p2p.post(sends, recvs, where)
            bi += 1

    def zeros() -> torch.Tensor:
        return torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)

    def take(i: int) -> Optional[torch.Tensor]:
        """The tensor action ``i`` receives from the neighbouring stage (None: data or loss)."""
        hands = rp.inputs[i]
        if not hands:
            return None
        if len(hands) > 1:
            raise NotImplementedError(f"pipeline rank {rank}: action {acts[i]} takes {len(hands)} tensors; "
                                      f"a stage compute takes one")
        (src, label), = hands
        return local.pop(label) if src == rank else p2p.receive(label, f"before action {i} ({acts[i]})")

    def hand_on(i: int, tensor: Optional[torch.Tensor], fake: bool) -> None:
        """Pass action ``i``'s result to the stages that wait for it: queue it for the next
        batch, or, on the same rank (DualPipeV's turn), hand it over directly."""
        a = acts[i]
        for dst, label in rp.outputs[i]:
            if tensor is None:
                raise RuntimeError(f"pipeline rank {rank}: backward {a} produced no input gradient to send to "
                                   f"stage {label[3]}; does the stage's input require grad?")
            if not fake:
                check_sendable(rank, a, "an activation" if a.op == F else "an input gradient", tensor, spec)
            if dst != rank:
                outbox[label] = (a, tensor)
            elif a.op == F and not fake:
                local[label] = tensor.detach().requires_grad_()
                compute.release(a, tensor)
            else:
                local[label] = tensor

    def released_before_backward(i: int) -> None:
        """A backward needs its forward's output released (Megatron's ``custom_backward``
        asserts it): complete that output's send if the background has not yet."""
        a = acts[i]
        label = unreleased.pop((a.dir, a.mb, a.stage), None) if a.is_backward else None
        if label is not None:
            p2p.complete_send(label, f"before action {i} ({a})")

    def run_one(i: int, inp: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        a = acts[i]
        if compute.is_fake(a):
            return None if a.op == W else zeros()
        if a.op == F:
            return compute.forward(a, inp)
        if a.op == W:
            compute.weight(a)
            return None
        return compute.backward(a, inp)

    # A compute written before forward_backward existed runs fused units as F then B.
    forward_backward = getattr(compute, "forward_backward", None) or \
        functools.partial(StageComputeBase.forward_backward, compute)
    try:
        for k, unit in enumerate(rp.units):
            post(k, f"before action {unit[0]} ({acts[unit[0]]})")
            p2p.reap()
            waited = time.perf_counter() if recording else 0.0
            inputs = [take(i) for i in unit]
            for i in unit:
                released_before_backward(i)
            started = time.perf_counter() if recording else 0.0
            if len(unit) == 2 and not any(compute.is_fake(acts[i]) for i in unit):
                results = forward_backward(acts[unit[0]], acts[unit[1]], *inputs)
            else:
                results = [run_one(i, x) for i, x in zip(unit, inputs)]
            for i, r in zip(unit, results):
                hand_on(i, r, compute.is_fake(acts[i]))
            if recording:
                recording.unit(unit, waited, started, time.perf_counter())
        post(len(rp.units), "after its last action")
        p2p.finish("after its last action")
    finally:
        p2p.close()
    leftovers = list(outbox) + list(local)
    if leftovers:
        raise RuntimeError(f"pipeline rank {rank}: tensors left over after the schedule: {leftovers}")
    if recording:
        recording.end()
    return RunStats(peak_in_flight=p2p.peak_in_flight)

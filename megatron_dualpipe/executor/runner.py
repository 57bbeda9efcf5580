"""Interpret one rank's ops of a ``schedule.lowering.program.Program`` up to ``finish``.

The runner knows nothing about Megatron (a :class:`StageCompute` says what F, B, W and a fused
F&B unit are) and re-derives nothing: the communication plan says which tensor each action takes
and hands on. It owns the tensors in flight, including the local hand-over at the turn of
DualPipeV's "V". Padding actions run as nothing. Whatever else happens at a point of the schedule
is a :class:`~.listeners.RunListener`; the ops the code around the runner issues
(``lowering.DELEGATED``) are handed to the listeners where the list has them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ..schedule import F, W, Action
from ..schedule.comm import Label
from ..schedule.lowering import DELEGATED, LoweringError, Op, OpKind, after_finish
from ..schedule.lowering.program import Program
from .listeners import RunListener, Unit
from .p2p import P2P
from .trace import TraceRecorder, trace_from_env


# The kinds as module names: an enum member looked up on its class costs several globals (3.11).
_POST, _BEGIN, _RECV, _RELEASE, _RUN, _FINISH = (OpKind.POST, OpKind.BEGIN, OpKind.RECV, OpKind.RELEASE, OpKind.RUN,
                                                 OpKind.FINISH)


class StageCompute(Protocol):
    """What the actions mean for a model. Padding actions (``Program.padding``) never reach it:
    the runner passes zeros of the right shape instead."""

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
    """Defaults a :class:`StageCompute` can inherit; a compute that overlaps a fused unit (DeepSeek's
    ``overlapped_forward_backward``) overrides :meth:`forward_backward`."""

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


def check_sendable(rank: int, a: Action, what: str, t: torch.Tensor, spec: TensorSpec) -> None:
    """Every tensor passed between stages must have ``spec``'s shape and dtype: the receiver allocates
    from ``spec`` (gloo silently accepts a smaller message and aborts on a larger one)."""
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
             trace: Optional[TraceRecorder] = None, listeners: Sequence[RunListener] = ()) -> RunStats:
    """Run this rank's actions; raises on timeout naming the action that waited. ``listeners`` are
    told of every unit and action; ``trace`` (or ``MEGATRON_DUALPIPE_TRACE``) records their times."""
    recorder = trace if trace is not None else trace_from_env()
    recording = recorder.begin(program, rank, p2p.global_ranks) if recorder is not None else None
    if recording is not None:
        listeners = (*listeners, recording)
    return RankRun(program, rank, compute, p2p, spec, listeners).run()


class RankRun:
    """One ``run_rank`` call. Tensors in flight: ``local`` (handed over on this rank at DualPipeV's
    turn), ``outbox`` (waiting for their batch's send), ``received`` (waited, not yet taken)."""

    def __init__(self, program: Program, rank: int, compute: StageCompute, p2p: P2P, spec: TensorSpec,
                 listeners: Sequence[RunListener] = ()):
        self.actions, self.plan = program.actions[rank], program.plans[rank]
        ops = program.ops[rank]
        self.ops = ops[:after_finish(ops)]
        self.rank, self.compute, self.p2p, self.spec = rank, compute, p2p, spec
        self.listeners = tuple(listeners)
        self.padding = program.padding[rank]
        # A compute written before forward_backward existed runs fused units as F then B.
        self.forward_backward = getattr(compute, "forward_backward", None) or \
            functools.partial(StageComputeBase.forward_backward, compute)
        self.local: Dict[Label, torch.Tensor] = {}
        self.outbox: Dict[Label, Tuple[Action, torch.Tensor, bool]] = {}  # label -> (action, result, padding)
        self.received: Dict[Label, torch.Tensor] = {}

    def run(self) -> RunStats:
        try:
            for op in self.ops:
                self.execute(op)
        finally:
            self.p2p.close()
        self.check_nothing_left()
        for listener in self.listeners:
            listener.on_run_end()
        return RunStats(peak_in_flight=self.p2p.peak_in_flight)

    def execute(self, op: Op) -> None:
        """One op: the only place the runner decides anything, and it decides nothing the op does not say."""
        kind = op.kind
        if kind is _RUN:
            unit = self.plan.units[op.index]
            for listener in self.listeners:
                listener.on_unit_start(unit)
            self.hand_on(unit, self.compute_unit(unit, [self.take(i) for i in unit]))
            self.tell_end(unit)
        elif kind is _RECV:
            self.received[op.label] = self.p2p.receive(op.label, self.where(op.index))
        elif kind is _RELEASE:
            self.p2p.complete_send(op.label, self.where(op.index))
        elif kind is _BEGIN:
            self.p2p.reap()
            for listener in self.listeners:
                listener.on_unit_waiting(self.plan.units[op.index])
        elif kind is _POST:
            self.post_batch(op.index)
        elif kind in DELEGATED:
            for listener in self.listeners:
                listener.on_op(op)
        elif kind is _FINISH:
            self.p2p.finish("after its last action")
        else:
            raise LoweringError(f"pipeline rank {self.rank}: unknown op {op.text()!r}")

    # -- the steps of one unit ------------------------------------------------------------------
    def where(self, k: int) -> str:
        """Where unit ``k`` stands, for errors."""
        units = self.plan.units
        if k < 0 or k >= len(units):
            return "after its last action"
        return f"before action {units[k][0]} ({self.actions[units[k][0]]})"

    def post_batch(self, index: int) -> None:
        """Post planned batch ``index``: the results in the outbox, fresh receive buffers."""
        b, spec = self.plan.batches[index], self.spec
        sends = [self._send(t.peer, t.label) for t in b.sends]
        recvs = [(t.peer, torch.empty(spec.shape, dtype=spec.dtype, device=spec.device,
                                      requires_grad=t.label[0] == "act"), t.label) for t in b.recvs]
        self.p2p.post(sends, recvs, self.where(b.unit))

    def _send(self, peer: int, label: Label):
        """One send of a batch; a real forward's output is released once sent."""
        a, out, fake = self.outbox.pop(label)
        release = functools.partial(self.compute.release, a, out) if a.op == F and not fake else None
        return peer, out, label, release

    def take(self, i: int) -> Optional[torch.Tensor]:
        """The tensor action ``i`` receives from the neighbouring stage (None: data or loss)."""
        hands = self.plan.inputs[i]
        if not hands:
            return None
        if len(hands) > 1:
            raise NotImplementedError(f"pipeline rank {self.rank}: action {self.actions[i]} takes {len(hands)} "
                                      f"tensors; a stage compute takes one")
        (src, label), = hands
        return self.local.pop(label) if src == self.rank else self.received.pop(label)

    def compute_unit(self, unit: Unit, inputs: List[Optional[torch.Tensor]]) -> Sequence[Optional[torch.Tensor]]:
        """Run the unit: a fused F&B in one call, else each action (padding as zeros, no compute)."""
        acts, padding = self.actions, self.padding
        if len(unit) == 2 and not (padding[unit[0]] or padding[unit[1]]):
            return self.forward_backward(acts[unit[0]], acts[unit[1]], *inputs)
        return [self.compute_one(i, x) for i, x in zip(unit, inputs)]

    def compute_one(self, i: int, inp: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        a = self.actions[i]
        if self.padding[i]:
            return None if a.op == W else torch.zeros(self.spec.shape, dtype=self.spec.dtype, device=self.spec.device)
        if a.op == F:
            return self.compute.forward(a, inp)
        if a.op == W:
            self.compute.weight(a)
            return None
        return self.compute.backward(a, inp)

    def hand_on(self, unit: Unit, results: Sequence[Optional[torch.Tensor]]) -> None:
        """Queue each result for its batch's send, or hand it over on this rank (DualPipeV's turn)."""
        for i, tensor in zip(unit, results):
            a, fake = self.actions[i], self.padding[i]
            for dst, label in self.plan.outputs[i]:
                if tensor is None:
                    raise RuntimeError(f"pipeline rank {self.rank}: backward {a} produced no input gradient to "
                                       f"send to stage {label[3]}; does the stage's input require grad?")
                if not fake:
                    check_sendable(self.rank, a, "an activation" if a.op == F else "an input gradient", tensor,
                                   self.spec)
                if dst != self.rank:
                    self.outbox[label] = (a, tensor, fake)
                elif a.op == F and not fake:
                    self.local[label] = tensor.detach().requires_grad_()
                    self.compute.release(a, tensor)
                else:
                    self.local[label] = tensor

    def tell_end(self, unit: Unit) -> None:
        for listener in self.listeners:
            for i in unit:
                listener.on_action_end(self.actions[i])
            listener.on_unit_end(unit)

    def check_nothing_left(self) -> None:
        leftovers = list(self.outbox) + list(self.local) + list(self.received)
        if leftovers:
            raise RuntimeError(f"pipeline rank {self.rank}: tensors left over after the schedule: {leftovers}")

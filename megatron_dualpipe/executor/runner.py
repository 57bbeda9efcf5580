"""Interpret one rank's schedule: the actions, in order, with the planned batches of P2P.

The runner knows nothing about Megatron: a :class:`StageCompute` says what a forward, a
backward and a deferred weight gradient are for this rank's model chunks. It owns the
tensors in flight: receive buffers, outputs waiting to be sent, and the local hand-over at the
turn of DualPipeV's "V" (stage pp-1 to stage pp on the last rank).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ..schedule import F, W, Action, build_schedule
from ..schedule.comm import Label, RankPlan, plan
from ..schedule.generators import Schedule
from .p2p import P2P


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


def describe(label: Label) -> str:
    kind, d, mb, stage = label
    what = "activation" if kind == "act" else "gradient"
    return f"{what} of micro-batch {mb} of direction {d} for stage {stage}"


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


def run_rank(program: Program, rank: int, compute: StageCompute, p2p: P2P, spec: TensorSpec) -> None:
    """Run this rank's actions; raises on timeout with the action it was about to run."""
    layout = program.schedule.layout
    acts = program.actions[rank]
    rp = program.plans[rank]
    inbox: Dict[Label, torch.Tensor] = {}
    outbox: Dict[Label, Tuple[Action, torch.Tensor]] = {}
    local: Dict[Tuple[str, int, int, int], torch.Tensor] = {}
    batches = rp.batches
    bi = 0

    def flush(upto_unit: int, where: str) -> None:
        nonlocal bi
        while bi < len(batches) and batches[bi].unit <= upto_unit:
            b = batches[bi]
            sends = [(t.peer, outbox[t.label][1], t.label) for t in b.sends]
            recvs = []
            for t in b.recvs:
                buf = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device, requires_grad=t.label[0] == "act")
                inbox[t.label] = buf
                recvs.append((t.peer, buf, t.label))
            p2p.exchange(sends, recvs, where, describe)
            for t in b.sends:
                a, out = outbox.pop(t.label)
                if a.op == F and not compute.is_fake(a):
                    compute.release(a, out)
            bi += 1

    def zeros() -> torch.Tensor:
        return torch.zeros(spec.shape, dtype=spec.dtype, device=spec.device)

    def take(kind: str, a: Action, source) -> Optional[torch.Tensor]:
        """What ``a`` receives from the neighbouring stage ``source`` (None: data or loss)."""
        if source is None:
            return None
        box = local if layout.rank_of(*source) == rank else inbox
        return box.pop((kind, a.dir, a.mb, a.stage))

    def hand_on(kind: str, a: Action, dest, tensor: torch.Tensor, fake: bool) -> None:
        """Pass ``a``'s result to the neighbouring stage ``dest``: queue it for the next batch,
        or, on the same rank (DualPipeV's turn), hand it over directly."""
        if not fake:
            check_sendable(rank, a, "an activation" if kind == "act" else "an input gradient", tensor, spec)
        key = (kind, dest[0], a.mb, dest[1])
        if layout.rank_of(*dest) != rank:
            outbox[key] = (a, tensor)
        elif kind == "act" and not fake:
            local[key] = tensor.detach().requires_grad_()
            compute.release(a, tensor)
        else:
            local[key] = tensor

    for k, unit in enumerate(rp.units):
        flush(k, f"before action {k} ({acts[unit[0]]})")
        for i in unit:
            a = acts[i]
            fake = compute.is_fake(a)
            prev, nxt = layout.prev_hop(a.dir, a.stage), layout.next_hop(a.dir, a.stage)
            if a.op == F:
                inp = take("act", a, prev)
                out = zeros() if fake else compute.forward(a, inp)
                if nxt is not None:
                    hand_on("act", a, nxt, out, fake)
            elif a.op == W:
                if not fake:
                    compute.weight(a)
            else:
                grad = take("grad", a, nxt)
                g = zeros() if fake else compute.backward(a, grad)
                if prev is not None:
                    if g is None:
                        raise RuntimeError(f"pipeline rank {rank}: backward {a} produced no input gradient to send "
                                           f"to stage {prev[1]}; does the stage's input require grad?")
                    hand_on("grad", a, prev, g, fake)
    flush(len(rp.units), "after its last action")
    leftovers = list(inbox) + list(outbox) + list(local)
    if leftovers:
        raise RuntimeError(f"pipeline rank {rank}: tensors left over after the schedule: {leftovers}")

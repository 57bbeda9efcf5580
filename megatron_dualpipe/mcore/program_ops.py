"""The ops of a rank's program that the Megatron glue issues: the collectives around the schedule.

The runner hands every op it does not run itself (``schedule.lowering.DELEGATED``) to its listeners; the ops
after ``finish`` run after the schedule, outside Megatron's ``no_sync``, in list order. :class:`ProgramOps`
issues each where the list has it (``ProgramOps._do`` names who issues each kind) and decides none of their places.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from ..executor.listeners import RunListener
from ..schedule.lowering import LoweringError, Op, OpKind
from ..schedule.lowering.collectives import TOKEN_COUNT
from . import loss_gather, param_gather
from .finalize import all_reduce_token_count, finalize_after_token_count


class ProgramOps(RunListener):
    """One rank's iteration: ``it`` is ``forward_backward._Iteration``, ``compute`` holds the loss store
    and token count."""

    def __init__(self, ops: Sequence[Op], *, it, model, config, compute, reduction, forward_only: bool,
                 force_all_reduce: Optional[bool], timeout_s: float, describe: str = ""):
        self.it, self.model, self.config, self.compute, self.reduction = it, model, config, compute, reduction
        self.forward_only, self.force_all_reduce, self.timeout_s, self.describe = (
            forward_only, force_all_reduce, timeout_s, describe)
        self.gathers = [op.index for op in ops if op.kind == OpKind.GATHER]
        self.started: List[int] = []
        self.received: dict = {}
        self._tokens: Optional[torch.Tensor] = None
        reductions = (OpKind.FINAL, OpKind.SUM, OpKind.SUMMED, OpKind.SETTLE, OpKind.DP)
        self._do = {**{kind: self._reduce for kind in reductions}, OpKind.GATHER: self._gather,
                    OpKind.GATHERED: self._gathered, OpKind.LOSS_SEND: self._send_losses,
                    OpKind.LOSS_RECV: self._receive_losses, OpKind.COLL: self._coll, OpKind.FINALIZE: self._finalize}

    def on_op(self, op: Op) -> None:
        do = self._do.get(op.kind)
        if do is None:
            raise LoweringError(f"pipeline rank {self.it.rank}: no code issues op {op.text()!r}")
        do(op)

    def after_schedule(self, ops: Sequence[Op]) -> List[Any]:
        """The program's ops after ``finish``, in order; the loss entries Megatron reads (rank pp-1)."""
        for op in ops:
            self.on_op(op)
        if self.reduction is not None:
            self.reduction.complete()
        return loss_gather.losses_on_last_rank(self.compute.loss_store, self.it.program.schedule.layout, self.it.rank,
                                               self.received)

    # -- the ops -------------------------------------------------------------------------------------
    def _gather(self, op: Op) -> None:
        param_gather.start(self.config, self.model, op.index, self.gathers, self.describe)
        self.started.append(op.index)

    def _gathered(self, op: Op) -> None:
        if op.index not in self.started:
            raise RuntimeError(f"megatron-dualpipe: the program waits for chunk {op.index}'s parameter all-gathers "
                               f"before starting them (a bug)")

    def _reduce(self, op: Op) -> None:
        if self.reduction is None:
            raise RuntimeError(f"megatron-dualpipe: {op.text()!r} in a program without gradient reduction (a bug)")
        self.reduction.on_reduction(op.kind, op.index)

    def _peer_args(self, op: Op):
        it = self.it
        return it.rank, op.peer, it.global_ranks, it.group, it.tensor_spec.device, self.timeout_s

    def _mtp(self) -> bool:
        return not self.forward_only and bool(getattr(self.config, "mtp_num_layers", None))

    def _send_losses(self, op: Op) -> None:
        loss_gather.send_losses(self.compute.loss_store[op.index], *self._peer_args(op))
        if self._mtp():
            loss_gather.send_mtp_tracker(*self._peer_args(op))

    def _receive_losses(self, op: Op) -> None:
        self.received[op.index] = loss_gather.receive_losses(*self._peer_args(op))
        if self._mtp():
            loss_gather.receive_mtp_tracker(*self._peer_args(op))

    def _token_count(self) -> Optional[torch.Tensor]:
        """The tokens whose loss this rank computed, on the device, with per-token loss (else None)."""
        if self._tokens is None and self.config.calculate_per_token_loss:
            device = self.it.tensor_spec.device
            total = self.compute.total_num_tokens
            self._tokens = (total if total is not None else torch.zeros([], dtype=torch.int)).to(device)
        return self._tokens

    def _coll(self, op: Op) -> None:
        if (op.what, op.group) != (TOKEN_COUNT, "pp"):
            raise LoweringError(f"pipeline rank {self.it.rank}: no code issues op {op.text()!r}")
        if self.config.finalize_model_grads_func is not None and len(self.model) == 2:
            all_reduce_token_count(self._token_count())

    def _finalize(self, op: Op) -> None:
        finalize = self.config.finalize_model_grads_func
        if finalize is not None and len(self.model) == 2:
            finalize_after_token_count(self.model, self._token_count(), finalize_func=finalize,
                                       force_all_reduce=self.force_all_reduce)
        elif finalize is not None:
            finalize(self.model, self._token_count(), force_all_reduce=self.force_all_reduce)

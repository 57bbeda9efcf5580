"""Synthetic pipeline stages whose forward, backward and weight gradient take given times.

Two ways to spend a cost: ``sleep`` (default; the process sleeps, so pp processes on a few
cores do not compete for them and only the schedule and the communication decide the
iteration time) and ``matmul`` (square matrix products on the tensors' device, calibrated once
per process: what a GPU run needs, where sleeping would not load the device).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..executor.runner import StageComputeBase
from ..schedule.actions import BW, Action

SPEND_MODES = ("sleep", "matmul")


@dataclass(frozen=True)
class StageCosts:
    """Milliseconds per action of one stage (``w``: the weight-gradient part of ``b``; ``fb``: a fused F&B unit)."""

    f: float
    b: float
    w: float
    fb: Optional[float] = None

    def backward(self, a: Action) -> float:
        return self.b if a.op == BW else self.b - self.w


def synchronize(device: torch.device) -> None:
    if device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize()


class Spender:
    """Spends milliseconds, by sleeping or by multiplying ``size`` x ``size`` matrices."""

    def __init__(self, mode: str, device: torch.device, size: int = 1024):
        if mode not in SPEND_MODES:
            raise ValueError(f"unknown compute mode {mode!r}: choose {' or '.join(SPEND_MODES)}")
        self.mode, self.device = mode, device
        self.busy_s = 0.0
        self.per_ms = 0.0
        self.slack_s = 5e-4
        self.owed_ms = 0.0
        if mode == "matmul":
            self.a = torch.randn(size, size, device=device)
            self.b = torch.randn(size, size, device=device)
            self.per_ms = self._calibrate()

    def _calibrate(self) -> float:
        """Matrix products per millisecond on this device (after a warm-up)."""
        n = 4
        while True:
            synchronize(self.device)
            t0 = time.perf_counter()
            for _ in range(n):
                torch.mm(self.a, self.b)
            synchronize(self.device)
            dt = time.perf_counter() - t0
            if dt > 0.2 or n > 1 << 16:
                return n / (dt * 1e3)
            n *= 2

    def start_iteration(self) -> None:
        self.busy_s = 0.0
        self.owed_ms = 0.0

    def spend(self, ms: float) -> None:
        """Spend ``ms``. Sleeping, what earlier actions of the iteration overran is taken off
        this one (never below half of it), so that a rank's compute adds up to its nominal
        costs even when the machine wakes sleepers late: that lateness is other jobs' load,
        not the schedule's."""
        t0 = time.perf_counter()
        if self.mode == "sleep":
            self._sleep_until(t0 + max(0.5 * ms, ms - self.owed_ms) / 1e3)
        else:
            for _ in range(round(ms * self.per_ms)):
                torch.mm(self.a, self.b)
        took = time.perf_counter() - t0
        self.busy_s += took
        self.owed_ms += took * 1e3 - ms

    def _sleep_until(self, end: float) -> None:
        """Sleep to ``end``: a loaded machine wakes a sleeper late (here 1-2 ms on 20 ms), so
        sleep short by the lateness seen so far and yield-wait the rest."""
        while True:
            left = end - time.perf_counter()
            if left <= 0:
                return
            if left > self.slack_s:
                t = time.perf_counter()
                time.sleep(left - self.slack_s)
                late = time.perf_counter() - t - (left - self.slack_s)
                self.slack_s = min(max(0.8 * self.slack_s + 0.2 * late, 1e-4), 3e-3)
            else:
                time.sleep(0)


class SyntheticCompute(StageComputeBase):
    """The executor's stage compute with fixed costs; counts live activations as the simulator
    does (+1 at F, -1 at B or BW). With ``costs.fb`` a fused F&B unit costs ``fb`` (one
    ``forward_backward`` call); without it, F then B, as the default does."""

    def __init__(self, costs: StageCosts, spender: Spender, shape, dtype=torch.float32, on_grad=None):
        self.costs, self.spender = costs, spender
        self.on_grad = on_grad or (lambda a: None)  # told of every gradient action (bench.bd_sum)
        self.out = torch.zeros(shape, dtype=dtype, device=spender.device)
        self.live = 0
        self.peak_live = 0

    def _forwarded(self) -> None:
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)

    def forward(self, a: Action, input_tensor):
        self.spender.spend(self.costs.f)
        self._forwarded()
        return self.out.clone()

    def backward(self, a: Action, output_grad):
        self.spender.spend(self.costs.backward(a))
        self.live -= 1
        self.on_grad(a)
        return self.out.clone()

    def weight(self, a: Action) -> None:
        self.spender.spend(self.costs.w)
        self.on_grad(a)

    def release(self, a: Action, output) -> None:
        pass

    def forward_backward(self, f_action: Action, b_action: Action, input_tensor, output_grad):
        if self.costs.fb is None:
            return super().forward_backward(f_action, b_action, input_tensor, output_grad)
        self.spender.spend(self.costs.fb)
        self._forwarded()
        self.live -= 1
        self.on_grad(b_action)
        return self.out.clone(), self.out.clone()


class _Spend(torch.autograd.Function):
    """Identity plus a parameter, costing ``f`` forward and ``bwd`` backward."""

    @staticmethod
    def forward(ctx, x, p, spender, f_ms, bwd_ms):
        spender.spend(f_ms)
        ctx.spender, ctx.bwd_ms = spender, bwd_ms
        return x + p

    @staticmethod
    def backward(ctx, grad):
        ctx.spender.spend(ctx.bwd_ms)
        return grad, grad.sum(0), None, None, None


class SyntheticStage(torch.nn.Module):
    """A ``torch.distributed.pipelining`` stage with the same costs: forward ``f``; autograd
    backward ``b - w``; the rest, ``w``, is spent by :func:`weight_runner` (the stage's
    ``dw_builder``), which torch calls right after a full backward and at a deferred W."""

    def __init__(self, costs: StageCosts, spender: Spender, hidden: int):
        super().__init__()
        self.costs, self.spender = costs, spender
        self.p = torch.nn.Parameter(torch.zeros(hidden, device=spender.device))

    def forward(self, x):
        return _Spend.apply(x, self.p, self.spender, self.costs.f, self.costs.b - self.costs.w)


def weight_runner(stage: SyntheticStage):
    """A ``dw_builder`` for ``PipelineStage``: each call returns one weight-gradient step."""
    return lambda: (lambda: stage.spender.spend(stage.costs.w))

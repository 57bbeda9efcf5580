"""Tensor-parallel communication of the TE layers (gloo on the CPU), plain and as autograd functions.

TE's ``Linear`` with ``parallel_mode="column"`` takes its input whole (all-reduces the input gradient) or,
with sequence parallelism, all-gathers it along the sequence (reduce-scatters the gradient); ``"row"``
all-reduces its output or reduce-scatters it along the sequence. Each collective is skipped for a group
of one. Nothing here is asynchronous: the results equal TE's overlapped ones.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world_size(group: Any = None) -> int:
    """Size of ``group`` (the default group for None), 1 without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_gather_first_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = world_size(group)
    if n == 1:
        return x
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter_first_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = world_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"reduce-scatter of {tuple(x.shape)} over {n} ranks: dim 0 does not divide")
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if world_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


class _Collective(torch.autograd.Function):
    """A collective forward and its adjoint backward: ``ctx.ops`` = (forward op, backward op)."""

    @staticmethod
    def forward(ctx, x, group, ops):
        ctx.group, ctx.backward_op = group, ops[1]
        return ops[0](x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad.contiguous(), ctx.group), None, None


def _identity(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x


def copy_to_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Column-parallel input: identity forward, all-reduced gradient."""
    return _Collective.apply(x, group, (_identity, all_reduce)) if world_size(group) > 1 else x


def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Row-parallel output: all-reduced forward, identity gradient."""
    return _Collective.apply(x, group, (all_reduce, _identity)) if world_size(group) > 1 else x


def gather_from_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence-parallel column input: all-gathered forward, reduce-scattered gradient."""
    if world_size(group) == 1:
        return x
    return _Collective.apply(x, group, (all_gather_first_dim, reduce_scatter_first_dim))


def scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sequence-parallel row output: reduce-scattered forward, all-gathered gradient."""
    if world_size(group) == 1:
        return x
    return _Collective.apply(x, group, (reduce_scatter_first_dim, all_gather_first_dim))

"""Where each token goes, computed on one rank without communication (csrc/kernels/layout.cu and
the channel bookkeeping of intranode.cu).

Experts are split evenly and in order over the ranks: expert ``e`` lives on rank
``e // (num_experts // num_ranks)`` as its local expert ``e % num_experts_per_rank``. A token goes to
a rank once, however many of its top-k experts live there; ``-1`` selects nothing. DeepEP splits
the tokens into ``num_sms // 2`` channels of consecutive tokens; the handle records per channel
how many tokens went to each rank, so the stand-in computes the same matrices.
"""
from __future__ import annotations

from typing import Tuple

import torch


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)``.

    ``num_tokens_per_expert`` counts every top-k entry naming the expert; indices outside
    ``[0, num_experts)`` count nowhere, and experts past ``num_ranks * (num_experts // num_ranks)``
    belong to no rank.
    """
    num_tokens = topk_idx.size(0)
    chosen = topk_idx[(topk_idx >= 0) & (topk_idx < num_experts)]
    per_expert = torch.bincount(chosen, minlength=num_experts).to(torch.int32)
    per_rank_experts = num_experts // num_ranks
    in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool)
    if per_rank_experts > 0:
        owned = (topk_idx >= 0) & (topk_idx < per_rank_experts * num_ranks)
        rank = torch.where(owned, topk_idx.div(per_rank_experts, rounding_mode="floor"), num_ranks)
        in_rank.scatter_(1, rank, True)
    is_token_in_rank = in_rank[:, :num_ranks].contiguous()
    return is_token_in_rank.sum(0, dtype=torch.int32), per_expert, is_token_in_rank


def local_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor, rank: int, num_local_experts: int
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The top-k as rank ``rank`` receives it: its own experts as local indices, every other entry
    ``-1`` with weight 0."""
    first = rank * num_local_experts
    mine = (topk_idx >= first) & (topk_idx < first + num_local_experts)
    idx = torch.where(mine, topk_idx - first, torch.full_like(topk_idx, -1))
    return idx, torch.where(mine, topk_weights, torch.zeros_like(topk_weights))


def channel_of_tokens(num_tokens: int, num_channels: int) -> torch.Tensor:
    """The channel of each token: ``ceil(num_tokens / num_channels)`` consecutive tokens a channel."""
    per_channel = max(-(-num_tokens // num_channels), 1)
    return torch.arange(num_tokens) // per_channel


def channel_prefix_matrix(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[R, C]`` int32: tokens of channels ``0..c`` sent to rank ``r`` (inclusive prefix)."""
    num_tokens, num_ranks = is_token_in_rank.shape
    counts = torch.zeros(num_channels, num_ranks, dtype=torch.int64)
    counts.index_add_(0, channel_of_tokens(num_tokens, num_channels), is_token_in_rank.to(torch.int64))
    return counts.cumsum(0).t().contiguous().to(torch.int32)


def send_head(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[T, R]`` int32: a token's place among its channel's tokens sent to that rank, -1 if not sent."""
    num_tokens, _ = is_token_in_rank.shape
    sent = is_token_in_rank.to(torch.int64)
    channel = channel_of_tokens(num_tokens, num_channels)
    before_channel = channel_prefix_matrix(is_token_in_rank, num_channels).t().to(torch.int64)
    before_channel = torch.cat([torch.zeros_like(before_channel[:1]), before_channel[:-1]])
    place = sent.cumsum(0) - 1 - before_channel[channel]
    return torch.where(is_token_in_rank, place, torch.full_like(place, -1)).to(torch.int32)


def exclusive_prefix(inclusive: torch.Tensor) -> torch.Tensor:
    """Start offsets from an inclusive prefix along the last dimension."""
    return torch.cat([torch.zeros_like(inclusive[..., :1]), inclusive[..., :-1]], dim=-1)

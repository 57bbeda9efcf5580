"""Dispatch and combine on one group: DeepEP's intranode kernels, as gloo all-to-alls.

What a rank receives is ordered as DeepEP orders it: by source rank, and within one source by
token index (DeepEP's channels are runs of consecutive tokens, drained in order). Combine sends
every received row back to its source, which adds, per token, any biases and then the rows of the
ranks it went to in rank order, in float32, and rounds once to the input dtype, as the kernel does.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from . import exchange, layout
from .checks import ep_assert

#: ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
#: is_token_in_rank, send_head)``: DeepEP's intranode handle, entry for entry.
Handle = Tuple[torch.Tensor, ...]


def send_order(is_token_in_rank: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """``(token, destination, per-rank counts)`` of the rows a rank sends: rank by rank, tokens in order."""
    pairs = is_token_in_rank.t().nonzero()
    counts = is_token_in_rank.sum(0).tolist()
    return pairs[:, 1], pairs[:, 0], counts


def received_counts(rank_prefix_matrix: torch.Tensor, rank: int) -> List[int]:
    """Rows ``rank`` received from each source, from the inclusive prefix over sources."""
    column = rank_prefix_matrix[:, rank].to(torch.int64)
    return (column - torch.cat([column.new_zeros(1), column[:-1]])).tolist()


def _counts_everywhere(group, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, num_channels):
    """Every rank's per-rank counts, per-expert counts and channel prefixes (one all-gather)."""
    ep_assert(torch.equal(num_tokens_per_rank.to(torch.int64), is_token_in_rank.sum(0)),
              "num_tokens_per_rank == is_token_in_rank.sum(0) (the stand-in checks what DeepEP assumes)")
    mine = layout.channel_prefix_matrix(is_token_in_rank, num_channels)
    gathered = exchange.all_gather_vector(torch.cat([
        num_tokens_per_rank.to(torch.int64), num_tokens_per_expert.to(torch.int64), mine.flatten().to(torch.int64)]),
        group)
    num_ranks, num_experts = is_token_in_rank.size(1), num_tokens_per_expert.numel()
    per_rank = gathered[:, :num_ranks]
    per_expert = gathered[:, num_ranks:num_ranks + num_experts]
    channels = gathered[:, num_ranks + num_experts:].reshape(num_ranks, num_ranks, num_channels)
    return mine, per_rank, per_expert, channels


def _payload(x, x_scales, topk_idx, topk_weights, token, destination, num_local_experts):
    parts = [x[token]] + ([x_scales[token]] if x_scales is not None else [])
    if topk_idx is not None:
        parts += layout.local_topk(topk_idx[token], topk_weights[token], destination.unsqueeze(1), num_local_experts)
    return parts + [token.to(torch.int32).unsqueeze(1)]


def dispatch(group, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
             num_tokens_per_expert, expert_alignment: int, num_channels: int):
    """``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``."""
    rank, num_ranks = group.rank(), group.size()
    mine, per_rank, per_expert, channels = _counts_everywhere(
        group, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, num_channels)
    local = num_tokens_per_expert.numel() // num_ranks
    token, destination, send_counts = send_order(is_token_in_rank)
    parts = _payload(x, x_scales, topk_idx, topk_weights, token, destination, local)
    rows = exchange.all_to_all_rows(exchange.pack_rows(parts), send_counts, per_rank[:, rank].tolist(), group)
    received = exchange.unpack_rows(rows, exchange.row_layout(parts))
    recv_x, recv_src_idx = received[0], received[-1].flatten().contiguous()
    recv_scales = received[1] if x_scales is not None else None
    recv_idx, recv_weights = (received[-3], received[-2]) if topk_idx is not None else (None, None)
    experts = per_expert[:, rank * local:(rank + 1) * local].sum(0)
    aligned = ((experts + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()
    handle = (per_rank.cumsum(0).to(torch.int32), mine,
              layout.exclusive_prefix(channels[:, rank, :]).to(torch.int32).contiguous(), recv_src_idx,
              is_token_in_rank, layout.send_head(is_token_in_rank, num_channels))
    return recv_x, recv_scales, recv_idx, recv_weights, aligned, handle


def cached_dispatch(group, x, x_scales, handle: Handle):
    """Dispatch along a former dispatch's handle (the backward of combine): ``(recv_x, recv_x_scales)``."""
    rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, _ = handle
    ep_assert(is_token_in_rank.size(0) == x.size(0), "is_token_in_rank.size(0) == x.size(0)")
    token, _, send_counts = send_order(is_token_in_rank)
    parts = [x[token]] + ([x_scales[token]] if x_scales is not None else [])
    recv_counts = received_counts(rank_prefix_matrix, group.rank())
    rows = exchange.all_to_all_rows(exchange.pack_rows(parts), send_counts, recv_counts, group)
    received = exchange.unpack_rows(rows, exchange.row_layout(parts))
    return received[0], (received[1] if x_scales is not None else None)


def _sum_by_rank(num_tokens, rows, token, counts, start: Optional[Sequence[torch.Tensor]] = ()):
    """Per token in float32: the ``start`` terms, then each rank's row in rank order."""
    total = torch.zeros(num_tokens, rows.size(1), dtype=torch.float32)
    for term in start:
        total += term.float()
    begin = 0
    for count in counts:
        total.index_add_(0, token[begin:begin + count], rows[begin:begin + count].float())
        begin += count
    return total


def combine(group, x, topk_weights, biases: Sequence[torch.Tensor], handle: Handle):
    """``(combined_x, combined_topk_weights or None)``: every received row back to its source, summed."""
    rank_prefix_matrix, _, _, _, is_token_in_rank, _ = handle
    token, _, sent_counts = send_order(is_token_in_rank)
    parts = [x] + ([topk_weights] if topk_weights is not None else [])
    back_counts = received_counts(rank_prefix_matrix, group.rank())
    rows = exchange.all_to_all_rows(exchange.pack_rows(parts), back_counts, sent_counts, group)
    received = exchange.unpack_rows(rows, exchange.row_layout(parts))
    num_tokens = is_token_in_rank.size(0)
    combined = _sum_by_rank(num_tokens, received[0], token, sent_counts, biases).to(x.dtype)
    weights = _sum_by_rank(num_tokens, received[1], token, sent_counts) if topk_weights is not None else None
    return combined, weights

"""DeepEP's host-side assertions (``EP_HOST_ASSERT``), raised as DeepEP raises them: RuntimeError.

A call DeepEP refuses on the GPU must fail on the CPU too, or a CPU test would pass where a GPU run
fails: the dtypes and shapes of every input, the rank counts its kernels are compiled for, the
stream arguments, and whether the buffer sizes the caller allocated hold what the call puts there.
"""
from __future__ import annotations

from typing import Optional

import torch

from .config import NUM_MAX_LOCAL_EXPERTS, NUM_MAX_NVL_PEERS, Config, topk_idx_t
from .errors import ep_assert, unsupported  # noqa: F401 - the checks' callers take them from here too

#: ``SWITCH_RANKS``: the rank counts the intranode kernels are instantiated for.
INTRANODE_RANKS = (2, 4, 8)
INT_BYTES, FLOAT_BYTES, INT4_BYTES = 4, 4, 16


def check_stream_arguments(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    """Allocating on the communication stream needs an event to wait for and an async call."""
    if allocate_on_comm_stream:
        has_event = getattr(previous_event, "event", None) is not None
        ep_assert(has_event and async_finish, "previous_event.has_value() and async (allocate_on_comm_stream)")


def check_intranode(num_ranks: int) -> None:
    if num_ranks > NUM_MAX_NVL_PEERS:
        raise unsupported(f"internode dispatch / combine ({num_ranks} ranks, over {NUM_MAX_NVL_PEERS})")
    ep_assert(num_ranks in INTRANODE_RANKS, f"num_ranks in {INTRANODE_RANKS} (Unsupported ranks: {num_ranks})")


def check_topk_idx(topk_idx: torch.Tensor) -> None:
    ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx.dim() == 2 and contiguous")
    ep_assert(topk_idx.dtype == topk_idx_t, f"topk_idx of {topk_idx_t}, got {topk_idx.dtype}")


def check_tokens(x: torch.Tensor, x_scales: Optional[torch.Tensor]) -> None:
    ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
    ep_assert(x.size(1) * x.element_size() % INT4_BYTES == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
    if x_scales is not None:
        ep_assert(x.element_size() == 1, "x.element_size() == 1 (FP8 tokens with scales)")
        ep_assert(x_scales.dtype in (torch.float32, torch.int32), "float or int x_scales")
        ep_assert(x_scales.dim() == 2 and x_scales.size(0) == x.size(0), "x_scales of [num_tokens, num_scales]")


def check_layout(x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, num_ranks) -> None:
    """The layout tensors a non-cached dispatch takes (from ``get_dispatch_layout``)."""
    ep_assert(is_token_in_rank.dtype == torch.bool, "is_token_in_rank of torch.bool")
    ep_assert(is_token_in_rank.dim() == 2 and is_token_in_rank.is_contiguous(), "is_token_in_rank 2-d, contiguous")
    ep_assert(tuple(is_token_in_rank.shape) == (x.size(0), num_ranks), "is_token_in_rank of [num_tokens, num_ranks]")
    ep_assert(num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_expert.dtype == torch.int32,
              "int32 num_tokens_per_rank and num_tokens_per_expert")
    ep_assert(num_tokens_per_rank.dim() == 1 and num_tokens_per_rank.size(0) == num_ranks,
              "num_tokens_per_rank of [num_ranks]")
    ep_assert(num_tokens_per_expert.dim() == 1 and num_tokens_per_expert.size(0) % num_ranks == 0,
              "num_tokens_per_expert->size(0) % num_ranks == 0")
    ep_assert(num_tokens_per_expert.size(0) // num_ranks <= NUM_MAX_LOCAL_EXPERTS,
              f"at most {NUM_MAX_LOCAL_EXPERTS} local experts")


def check_topk(x, topk_idx, topk_weights) -> None:
    ep_assert((topk_idx is None) == (topk_weights is None), "topk_idx.has_value() == topk_weights.has_value()")
    if topk_idx is None:
        return
    check_topk_idx(topk_idx)
    ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights 2-d, contiguous")
    ep_assert(topk_idx.size(0) == x.size(0) == topk_weights.size(0),
              "num_tokens == topk_idx.size(0) == topk_weights.size(0)")
    ep_assert(topk_idx.size(1) == topk_weights.size(1), "num_topk == topk_weights.size(1)")
    ep_assert(topk_weights.dtype == torch.float32, f"float32 topk_weights, got {topk_weights.dtype}")


def check_combine(x, num_recv_rows: int, topk_weights, biases, num_tokens: int) -> None:
    ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
    ep_assert(x.dtype == torch.bfloat16, f"a bfloat16 x in combine (Unsupported type: {x.dtype})")
    ep_assert(x.size(1) * x.element_size() % INT4_BYTES == 0, "(hidden * x.element_size()) % sizeof(int4) == 0")
    ep_assert(x.size(0) == num_recv_rows,
              f"src_idx.size(0) == num_tokens ({num_recv_rows} rows were received, got {x.size(0)})")
    if topk_weights is not None:
        ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights 2-d, contiguous")
        ep_assert(topk_weights.size(0) == x.size(0), "topk_weights->size(0) == num_tokens")
        ep_assert(topk_weights.dtype == torch.float32, f"float32 topk_weights, got {topk_weights.dtype}")
    for bias in biases:
        ep_assert(bias.dim() == 2 and bias.is_contiguous() and bias.dtype == x.dtype,
                  "bias 2-d, contiguous, of x's dtype")
        ep_assert(tuple(bias.shape) == (num_tokens, x.size(1)), "bias of [num_recv_tokens, hidden]")


def check_dispatch_bytes(num_nvl_bytes, config: Config, num_ranks, hidden_bytes, num_topk, num_scales,
                         num_local_experts: Optional[int]) -> None:
    """What the intranode dispatch puts into the NVLink buffer must fit in ``num_nvl_bytes``."""
    if num_local_experts is not None:  # non-cached: the counts exchanged first
        ep_assert(num_ranks * (num_ranks + num_local_experts) * INT_BYTES <= num_nvl_bytes,
                  "num_ranks * (num_ranks + num_local_experts) * sizeof(int) <= num_nvl_bytes")
    channels = config.num_sms // 2
    slots = channels * num_ranks * config.num_max_nvl_chunked_recv_tokens
    needed = (num_ranks * num_ranks * INT_BYTES + 4 * channels * num_ranks * INT_BYTES
              + slots * (hidden_bytes + INT_BYTES + num_topk * (8 + FLOAT_BYTES) + num_scales * FLOAT_BYTES))
    ep_assert(needed <= num_nvl_bytes, f"the dispatch's {needed} bytes <= num_nvl_bytes ({num_nvl_bytes})")


def check_combine_bytes(num_nvl_bytes, config: Config, num_ranks, hidden_bytes, num_topk) -> None:
    channels = config.num_sms // 2
    slots = channels * num_ranks * config.num_max_nvl_chunked_recv_tokens
    needed = 2 * channels * num_ranks * INT_BYTES + slots * (hidden_bytes + INT_BYTES + num_topk * FLOAT_BYTES)
    ep_assert(needed <= num_nvl_bytes, f"the combine's {needed} bytes <= num_nvl_bytes ({num_nvl_bytes})")

"""``deep_ep.Buffer``: DeepEP's v1 normal-mode buffer API over :mod:`.intranode`.

The signatures and return tuples are DeepEP's (``deep_ep/buffer.py`` of the v1 releases that
megatron-core's ``fused_a2a.py`` calls). Every call is a collective on ``group``, as on the GPU:
all ranks of the group must make it, in the same order.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import config as cfg
from . import intranode, layout
from .checks import (check_combine, check_combine_bytes, check_dispatch_bytes, check_intranode, check_layout,
                     check_stream_arguments, check_tokens, check_topk, check_topk_idx, ep_assert, unsupported)
from .utils import EventHandle, EventOverlap


def _event_after(async_finish: bool) -> EventOverlap:
    """What DeepEP returns after a call: an event when ``async_finish`` (complete here), else none."""
    return EventOverlap(EventHandle() if async_finish else None)


def _biases(bias) -> Tuple[torch.Tensor, ...]:
    if bias is None:
        return ()
    if isinstance(bias, torch.Tensor):
        return (bias,)
    assert len(bias) == 2
    return tuple(b for b in bias if b is not None)


def _not_stood_in(name: str):
    def method(self, *args, **kwargs):
        raise unsupported(f"Buffer.{name}")

    method.__name__ = name
    method.__doc__ = f"DeepEP's ``{name}``: not stood in for (NotImplementedError)."
    return method


class Buffer:
    """The expert-parallel communication buffer of one process group (normal mode, one node)."""

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None) -> None:
        if group is None:
            if comm is None:
                raise ValueError("Either 'group' or 'comm' must be provided.")
            raise unsupported("an mpi4py communicator in place of a process group")
        if low_latency_mode:
            raise unsupported("low-latency mode")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        for name, size in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            ep_assert(size % cfg.NUM_BUFFER_ALIGNMENT_BYTES == 0, f"{name} % NUM_BUFFER_ALIGNMENT_BYTES == 0")
        ep_assert(self.group_size < cfg.NUM_MAX_NVL_PEERS or self.group_size % cfg.NUM_MAX_NVL_PEERS == 0,
                  "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0")
        if self.group_size > cfg.NUM_MAX_NVL_PEERS:
            raise unsupported(f"an internode buffer ({self.group_size} ranks)")
        ep_assert(num_rdma_bytes == 0, "num_rdma_bytes == 0 within one node (num_ranks <= NUM_MAX_NVL_PEERS)")
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.enable_shrink = low_latency_mode, enable_shrink
        self.explicitly_destroy = explicitly_destroy
        self._destroyed = False

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._destroyed = True

    def _live(self) -> None:
        ep_assert(not self._destroyed, "the buffer is not destroyed")

    @staticmethod
    def is_sm90_compiled() -> bool:
        return False  # no GPU kernels at all

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> cfg.Config:
        return cfg.recommended(cfg.DISPATCH_CHUNKS, Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> cfg.Config:
        return cfg.recommended(cfg.COMBINE_CHUNKS, Buffer.num_sms, num_ranks)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event)`` (no RDMA ranks)."""
        self._live()
        check_stream_arguments(previous_event, async_finish, allocate_on_comm_stream)
        check_topk_idx(topk_idx)
        ep_assert(num_experts > 0, "num_experts > 0")
        per_rank, per_expert, in_rank = layout.dispatch_layout(topk_idx, num_experts, self.group_size)
        return per_rank, None, per_expert, in_rank, _event_after(async_finish)

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[cfg.Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``;
        with ``handle`` given (cached mode) only ``recv_x`` and the event, the rest None."""
        self._live()
        config = self.get_dispatch_config(self.group_size) if config is None else config
        tokens, scales = x if isinstance(x, tuple) else (x, None)
        check_stream_arguments(previous_event, async_finish, allocate_on_comm_stream)
        check_intranode(self.group_size)
        check_tokens(tokens, scales)
        if num_worst_tokens > 0:
            raise unsupported("num_worst_tokens (dispatch into a worst-case allocation)")
        with torch.no_grad():
            if handle is not None:
                return self._cached_dispatch(tokens, scales, handle, topk_idx, topk_weights, config, async_finish)
            return self._dispatch(tokens, scales, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                  topk_idx, topk_weights, expert_alignment, config, async_finish)

    def _cached_dispatch(self, tokens, scales, handle, topk_idx, topk_weights, config, async_finish):
        ep_assert(topk_idx is None and topk_weights is None,
                  "topk_idx is None and topk_weights is None (cached mode)")
        check_dispatch_bytes(self.num_nvl_bytes, config, self.group_size, tokens.size(1) * tokens.element_size(),
                             0, 0 if scales is None else scales.size(1), None)
        recv_x, recv_scales = intranode.cached_dispatch(self.group, tokens, scales, handle)
        recv = (recv_x, recv_scales) if scales is not None else recv_x
        return recv, None, None, None, None, _event_after(async_finish)

    def _dispatch(self, tokens, scales, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                  topk_idx, topk_weights, expert_alignment, config, async_finish):
        ep_assert(num_tokens_per_rank is not None and is_token_in_rank is not None
                  and num_tokens_per_expert is not None, "the layout of a non-cached dispatch")
        check_layout(tokens, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, self.group_size)
        check_topk(tokens, topk_idx, topk_weights)
        num_topk = 0 if topk_idx is None else topk_idx.size(1)
        check_dispatch_bytes(self.num_nvl_bytes, config, self.group_size, tokens.size(1) * tokens.element_size(),
                             num_topk, 0 if scales is None else scales.size(1),
                             num_tokens_per_expert.numel() // self.group_size)
        recv_x, recv_scales, recv_idx, recv_weights, per_expert, handle = intranode.dispatch(
            self.group, tokens, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
            num_tokens_per_expert, expert_alignment, config.num_sms // 2)
        recv = (recv_x, recv_scales) if scales is not None else recv_x
        return recv, recv_idx, recv_weights, per_expert, handle, _event_after(async_finish)

    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[cfg.Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(combined_x, combined_topk_weights, event)``: each token's rows from the ranks it went to,
        added (without weights) after ``bias``; ``topk_weights`` added the same way."""
        self._live()
        config = self.get_combine_config(self.group_size) if config is None else config
        check_stream_arguments(previous_event, async_finish, allocate_on_comm_stream)
        check_intranode(self.group_size)
        biases = _biases(bias)
        num_tokens = handle[4].size(0)
        check_combine(x, handle[3].size(0), topk_weights, biases, num_tokens)
        check_combine_bytes(self.num_nvl_bytes, config, self.group_size, x.size(1) * x.element_size(),
                            0 if topk_weights is None else topk_weights.size(1))
        with torch.no_grad():
            combined, weights = intranode.combine(self.group, x, topk_weights, biases, handle)
        return combined, weights, _event_after(async_finish)

    get_comm_stream = _not_stood_in("get_comm_stream")
    get_local_buffer_tensor = _not_stood_in("get_local_buffer_tensor")
    internode_dispatch = _not_stood_in("internode_dispatch")
    internode_combine = _not_stood_in("internode_combine")
    clean_low_latency_buffer = _not_stood_in("clean_low_latency_buffer")
    low_latency_dispatch = _not_stood_in("low_latency_dispatch")
    low_latency_combine = _not_stood_in("low_latency_combine")
    get_next_low_latency_combine_buffer = _not_stood_in("get_next_low_latency_combine_buffer")

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        raise unsupported("Buffer.get_low_latency_rdma_size_hint")

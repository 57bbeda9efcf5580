"""``deep_ep.Config`` and the constants DeepEP is compiled with (csrc/config.hpp, kernels/configs.cuh).

megatron-core sizes its buffer from ``Buffer.get_dispatch_config(n)`` / ``get_combine_config(n)``
and their ``get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint``; the stand-in gives the same
sizes, so the same buffer is allocated and the same size checks pass or fail.
"""
from __future__ import annotations

import torch

from .errors import ep_assert, unsupported

NUM_MAX_NVL_PEERS = 8
NUM_MAX_LOCAL_EXPERTS = 1024
NUM_BUFFER_ALIGNMENT_BYTES = 128
#: ``deep_ep.topk_idx_t``: the dtype of top-k expert indices (int64 in DeepEP's default build).
topk_idx_t = torch.int64

_MAX_TOPK = 128  # what the size hints assume at most
_MAX_SCALES = 128
_SOURCE_META_BYTES = 8  # internode SourceMeta: two ints (NVSHMEM builds count it in the NVL hint)


def _ceil_to(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class Config:
    """The performance-tuning config of one dispatch or combine: SMs and chunk sizes in tokens."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:

        ep_assert(num_sms >= 0, "num_sms >= 0")
        ep_assert(0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens,
                  "0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens")
        ep_assert(num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0,
                  "positive RDMA chunk sizes")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = _ceil_to(num_max_rdma_chunked_recv_tokens,
                                                         num_max_rdma_chunked_send_tokens)
        ep_assert(num_max_rdma_chunked_send_tokens <= self.num_max_rdma_chunked_recv_tokens // 2,
                  "num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens / 2")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NVLink buffer that one dispatch / combine of this config may use."""

        ep_assert(num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0,
                  "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = self.num_sms // 2 * nvl_ranks
        per_token = (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * (8 + 4) + _MAX_SCALES * 4)
        total = slots * (2 * rdma_ranks + 3) * 4 + slots * self.num_max_nvl_chunked_recv_tokens * per_token
        return _ceil_to(total, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0 within one node (at most 8 ranks); internode is not stood in for."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0

        raise unsupported(f"the internode RDMA buffer ({num_ranks} ranks)")

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl_send={self.num_max_nvl_chunked_send_tokens}, "
                f"nvl_recv={self.num_max_nvl_chunked_recv_tokens}, "
                f"rdma_send={self.num_max_rdma_chunked_send_tokens}, "
                f"rdma_recv={self.num_max_rdma_chunked_recv_tokens})")


#: ``Buffer.get_dispatch_config`` / ``get_combine_config``: ranks -> the chunk sizes of the config
#: (nvl send, nvl recv, rdma send, rdma recv); the SM count is ``Buffer.num_sms`` at the call.
DISPATCH_CHUNKS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
COMBINE_CHUNKS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


def recommended(table, num_sms: int, num_ranks: int) -> Config:
    """The config of ``table`` for ``num_ranks`` (an AssertionError for other counts, as DeepEP)."""
    assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
    return Config(num_sms, *table[num_ranks])

"""Stand-in for DeepEP's normal-mode (high-throughput) ``Buffer``, over torch.distributed on gloo.

megatron-core's flex token dispatcher (``--moe-token-dispatcher-type flex``, backend ``deepep``)
calls ``deep_ep.Buffer`` from ``transformer/moe/fused_a2a.py``: ``get_dispatch_layout``, ``dispatch``
and ``combine``, with ``EventOverlap`` / ``EventHandle`` from ``deep_ep.utils``. DeepEP needs NVLink
GPUs, so on CPU that path would never run. This package keeps the contract of DeepEP's v1 API
(``Buffer(group, num_nvl_bytes, num_rdma_bytes)``, the intranode kernels of csrc/kernels/
intranode.cu): the same layout, the same received rows in the same order with their top-k indices
mapped to local experts, the same handle, the same float32 sum in combine, the same refusals
(bfloat16-only combine, 2 / 4 / 8 ranks, buffer sizes). The exchange is
``torch.distributed.all_to_all_single`` on the given group; events are complete when made (the CPU
runs every operation to its end before returning).

Not stood in for: the low-latency kernels, internode (more than 8 ranks), ``num_worst_tokens``,
``HybridEPBuffer`` (megatron-core's hybridep backend stays unavailable, as without DeepEP's
hybrid-ep branch). Loaded only through :func:`megatron_dualpipe.cpu.stand_ins.install`.
"""
from .buffer import Buffer
from .config import Config, topk_idx_t
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]

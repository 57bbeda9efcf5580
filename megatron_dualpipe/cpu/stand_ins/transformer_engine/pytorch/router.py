"""``transformer_engine.pytorch.router``: TE's fused MoE router kernels.

megatron-core imports these three names unconditionally once TE claims 2.7 or newer, and calls them only
with ``moe_router_fusion=True``; on the CPU that option is refused here, in one line, at the call.
"""
from __future__ import annotations

from typing import Any

from .module.base import refuse


def _fused_router(name: str):
    def kernel(*args: Any, **kwargs: Any) -> Any:
        refuse(True, f"the fused router kernel {name} (moe_router_fusion=True; leave it off on the CPU)")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


fused_topk_with_score_function = _fused_router("fused_topk_with_score_function")
fused_compute_score_for_moe_aux_loss = _fused_router("fused_compute_score_for_moe_aux_loss")
fused_moe_aux_loss = _fused_router("fused_moe_aux_loss")

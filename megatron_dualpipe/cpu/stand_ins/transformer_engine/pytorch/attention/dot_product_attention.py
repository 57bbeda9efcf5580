"""``transformer_engine.pytorch.DotProductAttention`` (megatron-core's ``TEDotProductAttention``).

The core attention between the QKV and output projections, in ``sbhd`` or ``bshd`` layout, with
grouped-query heads, different query-key and value head sizes (multi-latent attention), causal / sliding
window / arbitrary masks, attention bias, dropout under the RNG tracker, and the per-head max logit for
qk-clip (``return_max_logit``). Refused in one line: packed sequences (``thd``), padding masks, context
parallelism over more than one rank, KV-cache inference, ALiBi and softmax types other than vanilla.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from ..distributed import checkpoint, get_distributed_world_size, set_all_rng_states
from ..module.base import TransformerEngineBaseModule, refuse
from ._masks import MASK_TYPES, canonical_mask_type, full_mask
from ._unfused import attention


class DotProductAttention(TransformerEngineBaseModule):
    """Scaled dot-product attention over ``num_attention_heads`` (split over ``tp_size``)."""

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, Tuple[int, int]],
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size: Optional[Tuple[int, int]] = None,
                 sequence_parallel: bool = False, tp_size: int = 1, get_rng_state_tracker: Optional[Callable] = None,
                 tp_group: Any = None, layer_number: Optional[int] = None, attention_type: str = "self",
                 cp_group: Any = None, cp_global_ranks: Optional[List[int]] = None, cp_stream: Any = None,
                 cp_comm_type: str = "p2p", softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: Optional[bool] = False, bottom_right_diagonal: Optional[bool] = None,
                 name: Optional[str] = None) -> None:
        super().__init__(name=name)
        refuse(softmax_type != "vanilla", f"softmax_type={softmax_type!r}")
        self.qkv_format, self.attn_mask_type = qkv_format, canonical_mask_type(attn_mask_type)
        self.window_size, self.attention_type = window_size, attention_type
        self._set_tp(tp_group, tp_size)
        self.num_attention_heads, self.layer_number = num_attention_heads, layer_number or 1
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.num_gqa_groups_per_partition = self.num_gqa_groups // self.tp_size
        if num_attention_heads % self.num_gqa_groups:
            raise AssertionError("The number of attention heads must be divisible by the number of GQA groups!")
        k_dim = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.hidden_size_per_attention_head_k = k_dim
        self.hidden_size_per_attention_head_v = kv_channels if isinstance(kv_channels, int) else kv_channels[1]
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_dim)
        self.attention_dropout, self.softmax_type = attention_dropout, softmax_type
        self.return_max_logit = bool(return_max_logit)
        self.rng_states_tracker = None
        if sequence_parallel or get_rng_state_tracker is None:
            self.attention_dropout_ctx = nullcontext
        else:
            self.rng_states_tracker = get_rng_state_tracker()
            set_all_rng_states(self.rng_states_tracker.get_states())
            self.attention_dropout_ctx = self.rng_states_tracker.fork
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_context_parallel_group(self, cp_group: Any, cp_global_ranks: Optional[List[int]], cp_stream: Any,
                                   cp_comm_type: str = "p2p") -> None:
        size = sum(get_distributed_world_size(g) for g in cp_group) if isinstance(cp_group, list) else \
            (get_distributed_world_size(cp_group) if cp_group is not None else 1)
        refuse(size > 1, "context parallelism (cp_group of more than one rank)")
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = \
            cp_group, cp_global_ranks, cp_stream, cp_comm_type

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask: Any = None, qkv_format: Optional[str] = None, cu_seqlens_q: Any = None,
                cu_seqlens_kv: Any = None, cu_seqlens_q_padded: Any = None, cu_seqlens_kv_padded: Any = None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                attn_mask_type: Optional[str] = None, window_size: Optional[Tuple[int, int]] = None,
                checkpoint_core_attention: bool = False, core_attention_bias_type: str = "no_bias",
                core_attention_bias: Optional[torch.Tensor] = None, alibi_slopes: Any = None,
                fast_zero_fill: bool = True, inference_params: Any = None, pad_between_seqs: Any = None,
                fp8_output: Optional[bool] = False, num_splits: Optional[int] = 1, **unused: Any):
        qkv_format = qkv_format or self.qkv_format
        kind = canonical_mask_type(attn_mask_type or self.attn_mask_type)
        refuse(qkv_format not in ("sbhd", "bshd"), f"qkv_format={qkv_format!r} (packed sequences)")
        refuse(kind not in MASK_TYPES, f"attn_mask_type={kind!r}")
        refuse(inference_params is not None, "inference_params (KV cache)")
        refuse(alibi_slopes is not None or core_attention_bias_type == "alibi", "ALiBi")
        self._enter_forward(query_layer)
        q, k, v = (t.transpose(0, 1) if qkv_format == "bshd" else t for t in (query_layer, key_layer, value_layer))
        mask = full_mask(q.shape[0], k.shape[0], kind, window_size if window_size is not None else self.window_size,
                         attention_mask, q.device)
        run = lambda *qkv: attention(  # noqa: E731
            *qkv, scale=self.softmax_scale, mask=mask, bias=core_attention_bias, bias_type=core_attention_bias_type,
            dropout=self.attention_dropout, training=self.training, dropout_ctx=self.attention_dropout_ctx,
            want_max_logit=self.return_max_logit)
        if checkpoint_core_attention:
            tracker = self.rng_states_tracker
            out, max_logit = checkpoint(run, q, k, v, get_rng_state_tracker=(lambda: tracker) if tracker else None)
        else:
            out, max_logit = run(q, k, v)
        out = out.transpose(0, 1).contiguous() if qkv_format == "bshd" else out
        return (out, max_logit) if self.return_max_logit else out

"""``transformer_engine.pytorch.attention``: core attention (no fused RoPE, no ``_SplitAlongDim``: megatron-core
falls back to its own when they are absent)."""
from .dot_product_attention import DotProductAttention  # noqa: F401

"""``transformer_engine.pytorch``: the layers, the autocast, the RNG tracker and checkpointing on the CPU.

Absent on purpose (megatron-core guards their imports and takes its own path): ``ops`` but two names,
``optimizers`` (fused Adam: megatron falls back to torch's), ``cpp_extensions`` (``te_general_gemm``: the
router runs its own GEMM), ``permutation``, ``cross_entropy``, ``cpu_offload``, ``graph`` (CUDA graphs),
``attention.rope`` (fused RoPE).
"""
from . import distributed, module, ops, quantization, router, tensor  # noqa: F401
from .attention import DotProductAttention  # noqa: F401
from .distributed import CudaRNGStatesTracker, checkpoint  # noqa: F401
from .module import (  # noqa: F401
    Fp8Padding,
    Fp8Unpadding,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    Linear,
    RMSNorm,
)
from .quantization import (  # noqa: F401
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
    quantized_model_init,
)
from . import fp8  # noqa: F401,E402

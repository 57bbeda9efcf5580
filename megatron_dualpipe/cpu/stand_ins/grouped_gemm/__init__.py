"""Stand-in for ``grouped_gemm`` (fanshiqing/grouped_gemm v1.1.4, the version megatron-core names).

megatron-core 0.16.1's legacy ``GroupedMLP`` (``--moe-grouped-gemm`` with the local spec) runs its
experts through ``grouped_gemm.ops.gmm``; the library is CUDA-only, so on CPU that path would never
run. This package keeps the library's contract, as its source states it: ``ops.gmm`` is an autograd
function over ``backend.gmm``, the grouped product takes bfloat16 only, accumulates in float32 and
rounds once (cuBLAS ``CUBLAS_COMPUTE_32F`` into a bfloat16 output), and rejects the same misuse
(int64 ``batch_sizes`` on the CPU, one size per group, contiguous operands).

Loaded only through :func:`megatron_dualpipe.cpu.stand_ins.install` (never where the real library
imports).
"""
from . import backend, ops  # noqa: F401  (the real package imports both on import)

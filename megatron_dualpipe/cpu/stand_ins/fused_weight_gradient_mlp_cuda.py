"""Stand-in for apex's ``fused_weight_gradient_mlp_cuda`` (``--gradient-accumulation-fusion``).

megatron-core's local linears (the output layer of every spec, the local spec's layers) with
``gradient_accumulation_fusion`` hand their weight gradient straight to the parameter's
``main_grad`` through this CUDA extension, and refuse to build without it. Its contract
(apex ``csrc/megatron/fused_weight_gradient_dense.cpp``): ``d_weight += d_output^T @ input`` for
2-D ``input`` [tokens, in] and ``d_output`` [tokens, out], accumulated in place into ``d_weight``
[out, in]: fp32 for ``wgrad_gemm_accum_fp32``, the inputs' half type for ``..._fp16``. The GEMM
accumulates in fp32 (cuBLAS with fp32 compute) and is added once.
"""
import torch


def _accumulate(input, d_output, d_weight):
    if input.dim() != 2 or d_output.dim() != 2 or input.shape[0] != d_output.shape[0]:
        raise RuntimeError(f"wgrad_gemm_accum: 2-D input and d_output with the same rows expected, got "
                           f"{tuple(input.shape)} and {tuple(d_output.shape)}")
    if tuple(d_weight.shape) != (d_output.shape[1], input.shape[1]):
        raise RuntimeError(f"wgrad_gemm_accum: d_weight {tuple(d_weight.shape)} is not "
                           f"({d_output.shape[1]}, {input.shape[1]})")
    d_weight.add_(d_output.float().t().matmul(input.float()).to(d_weight.dtype))


def wgrad_gemm_accum_fp32(input, d_output, d_weight):
    """``d_weight`` (fp32) += ``d_output``^T ``input``."""
    if d_weight.dtype != torch.float32:
        raise RuntimeError(f"wgrad_gemm_accum_fp32: d_weight must be float32, got {d_weight.dtype}")
    _accumulate(input, d_output, d_weight)


def wgrad_gemm_accum_fp16(input, d_output, d_weight):
    """``d_weight`` (fp16 or bf16, the inputs' type) += ``d_output``^T ``input``."""
    if d_weight.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"wgrad_gemm_accum_fp16: d_weight must be float16 or bfloat16, got {d_weight.dtype}")
    _accumulate(input, d_output, d_weight)

"""The checks of grouped_gemm's ``GroupedGemm`` (csrc/grouped_gemm.cu), raised as its ``TORCH_CHECK``s are.

A misuse that the real kernel refuses on the GPU must fail on the CPU too, or a CPU test would pass
where a GPU run fails. The device checks (``is_cuda``) are left out: in CPU mode every "CUDA"
tensor is a CPU tensor. One check is stricter than the library: the group sizes must add up to the
rows of ``a`` (cuBLAS would read past ``a`` or leave output rows unwritten).
"""
from __future__ import annotations

import torch


def expect(condition: bool, what: str) -> None:
    """``TORCH_CHECK``: a RuntimeError naming the broken expectation."""
    if not condition:
        raise RuntimeError(f"grouped_gemm (CPU stand-in): expected {what}")


def check_batch_sizes(batch_sizes: torch.Tensor) -> None:
    expect(batch_sizes.device.type == "cpu", "batch_sizes on the CPU")
    expect(batch_sizes.ndim == 1, "a 1-d batch_sizes")
    expect(batch_sizes.dtype == torch.int64, f"int64 batch_sizes, got {batch_sizes.dtype}")
    expect(bool((batch_sizes >= 0).all()), "non-negative batch_sizes")


def check_bf16(name: str, tensor: torch.Tensor, ndim: int) -> None:
    expect(tensor.ndim == ndim, f"a {ndim}-d '{name}', got shape {tuple(tensor.shape)}")
    expect(tensor.dtype == torch.bfloat16, f"bfloat16 '{name}', got {tensor.dtype}")


def check_gmm(a, b, batch_sizes, trans_a: bool, trans_b: bool) -> None:
    """Every check ``GroupedGemm`` makes before it launches (for ``trans_a``: ``GroupedGemmVariableK``)."""
    expect(not (trans_a and trans_b), "not both trans_a and trans_b")
    check_batch_sizes(batch_sizes)
    check_bf16("a", a, 2)
    total = int(batch_sizes.sum())
    if trans_a:
        check_bf16("b", b, 2)
        expect(a.size(0) == b.size(0), f"a and b with the same rows, got {a.size(0)} and {b.size(0)}")
        expect(total == a.size(0), f"batch_sizes adding up to the {a.size(0)} rows, got {total}")
        return
    check_bf16("b", b, 3)
    hidden_in = b.size(2) if trans_b else b.size(1)
    expect(hidden_in == a.size(1), f"a's {a.size(1)} columns to match b's contraction size {hidden_in}")
    expect(batch_sizes.size(0) == b.size(0), f"one batch size per group ({b.size(0)}), got {batch_sizes.size(0)}")
    expect(a.is_contiguous() and b.is_contiguous(), "contiguous a and b")
    expect(total == a.size(0), f"batch_sizes adding up to the {a.size(0)} rows of a, got {total}")


def check_output(c, shape, dtype) -> None:
    """The checks on a caller-given output ``c``."""
    expect(tuple(c.shape) == tuple(shape), f"an output of shape {tuple(shape)}, got {tuple(c.shape)}")
    expect(c.dtype == dtype, f"a {dtype} output, got {c.dtype}")

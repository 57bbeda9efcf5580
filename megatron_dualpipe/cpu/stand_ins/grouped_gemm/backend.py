"""``grouped_gemm.backend.gmm``: the grouped product without autograd.

``trans_a=False``: rows ``[s_i, s_i + batch_sizes[i])`` of ``a`` times ``b[i]`` (``b[i].T`` with
``trans_b``), stacked in group order: ``[tokens, hidden_out]``. ``trans_a=True`` (the weight
gradient): ``a_i.T @ b_i`` per group, ``[groups, a.size(1), b.size(1)]``, zero for an empty group.
Each product accumulates in float32 and is rounded to the input dtype once, as cuBLAS does with a
float32 compute type.
"""
from __future__ import annotations

import torch

from .checks import check_gmm, check_output


def _groups(tensor: torch.Tensor, batch_sizes: torch.Tensor):
    return torch.split(tensor, batch_sizes.tolist(), dim=0)


def _rows_times_groups(a, b, batch_sizes, trans_b):
    hidden_out = b.size(1) if trans_b else b.size(2)
    out = torch.empty(a.size(0), hidden_out, dtype=torch.float32, device=a.device)
    for i, (rows, dst) in enumerate(zip(_groups(a, batch_sizes), _groups(out, batch_sizes))):
        weight = b[i].t() if trans_b else b[i]
        torch.matmul(rows.float(), weight.float(), out=dst)
    return out.to(a.dtype)


def _groups_transposed_times_groups(a, b, batch_sizes):
    out = torch.empty(batch_sizes.size(0), a.size(1), b.size(1), dtype=torch.float32, device=a.device)
    for i, (lhs, rhs) in enumerate(zip(_groups(a, batch_sizes), _groups(b, batch_sizes))):
        torch.matmul(lhs.float().t(), rhs.float(), out=out[i])
    return out.to(a.dtype)


def gmm(a, b, batch_sizes, trans_a=False, trans_b=False, c=None):
    """The grouped GEMM; ``c``, when given, receives the result and is returned."""
    check_gmm(a, b, batch_sizes, trans_a, trans_b)
    with torch.no_grad():
        if trans_a:
            result = _groups_transposed_times_groups(a, b, batch_sizes)
        else:
            result = _rows_times_groups(a, b, batch_sizes, trans_b)
        if c is None:
            return result
        check_output(c, result.shape, a.dtype)
        c.copy_(result)
    return c

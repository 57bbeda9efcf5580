"""The single-process reference: the whole (pp=1) model over every micro-batch in a plain loop, each
micro-batch's own gradient kept, so one run serves every M and data-parallel split (:func:`mean_grad`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .data import masked_loss_func


def weights(model) -> Dict[str, torch.Tensor]:
    """The model's state dict without Transformer Engine's ``_extra_state`` entries, copied."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def per_microbatch(model, batches: Sequence[dict]) -> Tuple[List[float], List[Dict[str, torch.Tensor]]]:
    """Every micro-batch's loss and the gradient of that loss alone, by parameter name (float64, on
    the CPU: a reference to read, not to train)."""
    losses, grads = [], []
    for b in batches:
        model.zero_grad()
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        loss, _ = masked_loss_func(b["loss_mask"], out)
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad.detach().to(torch.float64, copy=True).cpu()
                      for k, p in model.named_parameters() if p.grad is not None})
    return losses, grads


def mean_grad(per_mb: Sequence[Dict[str, object]], key: str, m: Optional[int] = None) -> np.ndarray:
    """The mean of the first ``m`` (default: all) per-micro-batch gradients of ``key``, in float64."""
    chosen = per_mb[:m] if m is not None else per_mb
    return sum(np.asarray(g[key], dtype=np.float64) for g in chosen) / len(chosen)

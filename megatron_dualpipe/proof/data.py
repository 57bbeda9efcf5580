"""What the tiny GPT reads and how its loss is taken (random micro-batches, Megatron's masked loss,
``pretrain_gpt.forward_step``'s contract), the same for the reference and every schedule.
"""
from __future__ import annotations

import functools
from typing import Container, Dict, List

import torch


def make_gpt_batches(n: int, *, vocab: int, seq: int, mbs: int, seed: int = 7,
                     short: Container[int] = ()) -> List[Dict[str, torch.Tensor]]:
    """``n`` random micro-batches (tokens, labels, position ids, loss mask), the same for a seed.
    The last three positions are masked out (an average ignoring the mask would not match); those
    whose index is in ``short`` are 4 tokens shorter (a data error the executor must name)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(n):
        s = seq - 4 if i in short else seq
        tokens = torch.randint(0, vocab, (mbs, s + 1), generator=gen)
        loss_mask = torch.ones(mbs, s)
        loss_mask[:, -3:] = 0.0
        batches.append(dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                            position_ids=torch.arange(s).unsqueeze(0).expand(mbs, -1).contiguous(),
                            loss_mask=loss_mask))
    return batches


def masked_loss_func(loss_mask, output_tensor):
    """Megatron's 2-tuple loss contract: the masked mean of the per-token losses, and its report."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """``pretrain_gpt.forward_step``'s contract: the first stage reads tokens, the last labels and the
    loss mask (``parallel_state`` answers for the direction being computed), an MTP stage tokens and
    the loss mask too; with ``return_schedule_plan`` the model's plan for the combined step."""
    from megatron.core import parallel_state as ps

    inner = model
    while hasattr(inner, "module"):  # megatron DDP
        inner = inner.module
    first, last, mtp = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(), getattr(inner, "mtp_process", False)
    b = next(data_iterator) if (first or last or mtp) else None
    tokens, position_ids = (b["tokens"], b["position_ids"]) if (first or mtp) else (None, None)
    labels = b["labels"] if last else None
    loss = functools.partial(masked_loss_func, b["loss_mask"] if last else None)
    extra = {"loss_mask": b["loss_mask"]} if mtp else {}
    if return_schedule_plan:
        return model.build_schedule_plan(tokens, position_ids, None, labels=labels, **extra), loss
    return model(tokens, position_ids, None, labels=labels, **extra), loss

"""The token count of ``--calculate-per-token-loss`` reaches Megatron's finalize in Megatron's dtype on
every pipeline rank (issue 35, finding 3).

Megatron's schedules sum ``num_tokens`` into ``torch.zeros([], dtype=torch.int)`` in place, so the
count all-reduced over the pipeline group is int32 on every rank whatever the loss function returns.
DualPipe summed ``total + num_tokens``: a loss function returning an int64 count (here ``mask.sum()``
of an int64 mask) made it int64 on the ranks that compute a loss and left it int32 on the others,
one all-reduce over mixed dtypes. The reference count is computed here from the micro-batches.
"""
from __future__ import annotations

import torch

from harness import megatron_env as me
from megatron_dualpipe.proof import models, names, reference

M = 4


def _loss_with_int64_count(loss_mask, output_tensor):
    """Megatron's 3-tuple loss contract (summed loss, token count, report), the count as int64."""
    mask = loss_mask.reshape(-1).long()
    loss = torch.sum(output_tensor.float().reshape(-1) * mask)
    count = mask.sum()
    assert count.dtype == torch.int64
    return loss, count, {"lm loss": torch.stack([loss.detach(), count.float()])}


def _forward_step(data_iterator, model):
    import functools

    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    b = next(data_iterator) if (first or last) else None
    tokens, position_ids = (b["tokens"], b["position_ids"]) if first else (None, None)
    labels = b["labels"] if last else None
    return model(tokens, position_ids, None, labels=labels), functools.partial(
        _loss_with_int64_count, b["loss_mask"] if last else None)


def _worker(rank, world, port, schedule, full_state):
    from megatron.core import parallel_state as ps

    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import broadcast_mirrors, build_two_direction_model

    spec = models.ModelSpec(layers=4)
    me.init_distributed_cpu(rank, world, port, pp=world)
    try:
        build_bd_groups()
        layout = "v" if schedule == "dualpipev" else "bidirectional"
        model = build_two_direction_model(models.provider(spec, layout == "v"), layout_kind=layout)
        full = {k: torch.from_numpy(v) for k, v in full_state.items()}
        for chunk in (model if layout == "v" else model[:1]):
            names.load_stage_from_full(chunk, full)
        if layout != "v":
            broadcast_mirrors(model)
        seen = []
        for chunk in model:
            chunk.config.calculate_per_token_loss = True
            chunk.config.finalize_model_grads_func = lambda _m, tokens, **k: seen.append(
                (str(tokens.dtype), int(tokens)))
        forward_backward_dualpipe(forward_step_func=_forward_step, data_iterator=iter(spec.batches(M, seed=7)),
                                  model=model, num_microbatches=M, seq_length=spec.seq, micro_batch_size=spec.mbs,
                                  forward_only=False, schedule=schedule, p2p_timeout=60)
        return ps.get_pipeline_model_parallel_rank(), seen
    finally:
        me.destroy_distributed()


def _run(schedule):
    spec = models.ModelSpec(layers=4)
    [(state, _, _)] = me.run_workers(_reference_state, 1, args=(spec,), timeout=120)
    expected = sum(int(b["loss_mask"].sum()) for b in spec.batches(M, seed=7))
    results = me.run_workers(_worker, 2, args=(schedule, state), timeout=240)
    print(f"\n{schedule}: the token count finalize got per pipeline rank {dict(results)}; "
          f"counted from the micro-batches: {expected}")
    for rank, seen in results:
        assert seen == [("torch.int32", expected)], (rank, seen)


def _reference_state(rank, world, port, spec):
    me.init_distributed_cpu(rank, world, port)
    try:
        return reference.weights(models.provider(spec)()), None, None
    finally:
        me.destroy_distributed()


def test_an_int64_token_count_is_summed_as_megatrons_int32_on_every_rank_dualpipe():
    _run("dualpipe")


def test_an_int64_token_count_is_summed_as_megatrons_int32_on_every_rank_dualpipev():
    _run("dualpipev")

"""DualPipe and DualPipeV on real megatron-core GPTModels equal a single-process reference.

The reference (`_reference_worker`) is one process running the whole pp=1 GPTModel over every
micro-batch with a plain loop: loss_k / M, backward. It records each micro-batch's loss and its
unscaled gradient g_k, so the expected gradient for any M is (1/M) sum_{k<M} g_k.

The pipeline workers load the same weights into model[0] of every rank, broadcast them to the
mirrors, run `forward_backward_dualpipe` for several M (padding with fake micro-batches where
M < 2*pp or M is odd), and return every chunk's gradients after the bd all-reduce, keyed by the
full model's parameter names, plus the loss dicts the last rank returns. Every number is
printed; the tolerance is 1e-5 relative to the largest reference value (fp32).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from megatron_dualpipe.testing import megatron_env as me

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")

SEQ, MBS, VOCAB, LAYERS = 16, 2, 64, 8
RTOL = 1e-5


def make_batches(n, seed=7):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
        loss_mask = torch.ones(MBS, SEQ)
        loss_mask[:, -3:] = 0.0
        out.append(dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                        position_ids=torch.arange(SEQ).unsqueeze(0).expand(MBS, -1).contiguous(),
                        loss_mask=loss_mask))
    return out


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """Like pretrain_gpt's: only the first and last stage read data (through parallel_state,
    which the executor points at the direction being computed)."""
    from megatron.core import parallel_state as ps
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    b = next(data_iterator) if (first or last) else None
    tokens = b["tokens"] if first else None
    position_ids = b["position_ids"] if first else None
    labels = b["labels"] if last else None
    output = model(tokens, position_ids, None, labels=labels)
    mask = b["loss_mask"] if last else None
    return output, functools.partial(loss_func, mask)


def _reference_worker(rank, world, port, tied, n):
    me.init_distributed_cpu(rank, world, port)
    try:
        config = me.tiny_gpt_config(num_layers=LAYERS)
        model = me.build_tiny_gpt(config, share_embeddings_and_output_weights=tied, vocab_size=VOCAB,
                                  max_sequence_length=SEQ)
        state = {k: v.clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
        losses, per_mb = [], []
        for b in make_batches(n):
            model.zero_grad()
            out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            loss, _ = loss_func(b["loss_mask"], out)
            loss.backward()
            losses.append(loss.item())
            per_mb.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        return state, losses, per_mb
    finally:
        me.destroy_distributed()


def _provider(tied):
    def provider(pre_process, post_process, pg_collection=None, vp_stage=None):
        config = me.tiny_gpt_config(num_layers=LAYERS)
        return me.build_tiny_gpt(config, pre_process=pre_process, post_process=post_process,
                                 share_embeddings_and_output_weights=tied, vocab_size=VOCAB,
                                 max_sequence_length=SEQ, pg_collection=pg_collection, vp_stage=vp_stage)
    return provider


def _pipeline_worker(rank, world, port, schedule, tied, full_state, runs):
    """`runs`: list of (M, zero_bubble, forward_only). Returns per run: losses, grads."""
    from megatron.core import parallel_state as ps
    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import broadcast_mirrors, build_two_direction_model

    me.init_distributed_cpu(rank, world, port, pp=world)
    try:
        build_bd_groups()
        layout = "v" if schedule == "dualpipev" else "bidirectional"
        model = build_two_direction_model(_provider(tied), layout_kind=layout)
        full = {k: torch.from_numpy(v) for k, v in full_state.items()}
        me.load_stage_from_full(model[0], full)
        broadcast_mirrors(model)
        for chunk in model:
            chunk.config.finalize_model_grads_func = lambda *a, **k: None  # plain modules: no DDP to finish
        results = []
        for m, zero_bubble, forward_only in runs:
            for chunk in model:
                chunk.zero_grad()
            source = iter(make_batches(m))
            ctx = torch.no_grad() if forward_only else torch.enable_grad()
            with ctx:
                out = forward_backward_dualpipe(
                    forward_step_func=forward_step, data_iterator=source, model=model, num_microbatches=m,
                    seq_length=SEQ, micro_batch_size=MBS, forward_only=forward_only, schedule=schedule,
                    zero_bubble=zero_bubble, p2p_timeout=60)
            losses = [d["lm loss"].item() for d in out] if rank == world - 1 else None
            leftover = sum(1 for _ in source)  # what the schedule did not read
            grads = [me.stage_grads_as_full(chunk, full) for chunk in model] if not forward_only else None
            results.append({"losses": losses, "grads": grads, "unread": leftover})
        return results
    finally:
        me.destroy_distributed()


def _check(label, results, ref_losses, ref_per_mb, runs, world):
    worst = {}
    for i, (m, zb, fo) in enumerate(runs):
        tag = f"{label} M={m} zero_bubble={zb} forward_only={fo}"
        losses = results[world - 1][i]["losses"]
        assert losses is not None and len(losses) == m, f"{tag}: last rank returned {losses}"
        dl = max(abs(a - b) for a, b in zip(losses, ref_losses[:m]))
        assert dl <= RTOL * max(abs(x) for x in ref_losses[:m]), f"{tag}: losses {losses} vs {ref_losses[:m]}"
        # Ranks that read data (the first and last stages) read exactly M micro-batches; others none.
        for r in range(world):
            reads_data = r in (0, world - 1)
            assert results[r][i]["unread"] == (0 if reads_data else m), \
                f"{tag}: rank {r} left {results[r][i]['unread']} of {m} micro-batches unread"
        if fo:
            print(f"  {tag}: max|loss diff| {dl:.2e}")
            continue
        dg, scale = 0.0, 0.0
        for r in range(world):
            for chunk_grads in results[r][i]["grads"]:
                for key, g in chunk_grads.items():
                    want = sum(np.asarray(ref_per_mb[k][key], dtype=np.float64) for k in range(m)) / m
                    dg = max(dg, float(np.max(np.abs(np.asarray(g, dtype=np.float64) - want))))
                    scale = max(scale, float(np.max(np.abs(want))))
        print(f"  {tag}: max|loss diff| {dl:.2e}  max|grad diff| {dg:.2e} (rel {dg / scale:.2e})")
        assert dg <= RTOL * scale, f"{tag}: gradient differs by {dg:.3e} (scale {scale:.3e})"
        worst[tag] = dg / scale
    return worst


CASES = {
    # pp: runs of (M, zero_bubble, forward_only): M in {pp, pp+1, 2pp, 2pp+3, 3pp}
    2: [(2, True, False), (3, True, False), (4, True, False), (7, True, False), (6, False, False), (5, True, True)],
    4: [(4, True, False), (5, True, False), (8, True, False), (11, True, False), (12, False, False), (6, True, True)],
}


@pytest.mark.parametrize("pp", sorted(CASES))
@pytest.mark.parametrize("tied", [True, False])
def test_dualpipe_equals_single_process(pp, tied):
    runs = CASES[pp]
    n = max(m for m, _, _ in runs)
    [(state, ref_losses, ref_per_mb)] = me.run_workers(_reference_worker, 1, args=(tied, n), timeout=120)
    results = me.run_workers(_pipeline_worker, pp, args=("dualpipe", tied, state, runs), timeout=300)
    print(f"\ndualpipe pp={pp} tied={tied}:")
    _check(f"dualpipe pp={pp} tied={tied}", results, ref_losses, ref_per_mb, runs, pp)

"""The opt-in drift check (``mcore.drift``): both copies of every DualPipe stage bit-identical.

pp=2 tiny GPT, three SGD training steps through the executor with ``drift_check_every=1``: every
call checks and passes (the bd sum keeps the copies equal). Then one bit of one parameter of
rank 1's mirror copy of stage 0 is changed: both partners raise ``CopiesDriftedError`` naming
that parameter and the two ranks.
"""
from __future__ import annotations

import pytest
import torch

import test_dualpipe_megatron as tdm
from harness import megatron_env as me
from megatron_dualpipe.proof import models, names
from megatron_dualpipe.proof.data import forward_step

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")

PARAM = "decoder.layers.0.mlp.linear_fc1.weight"


def _worker(rank, world, port, full_state):
    from megatron_dualpipe.mcore.drift import CopiesDriftedError, check_copies_identical
    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import broadcast_mirrors, build_two_direction_model

    me.init_distributed_cpu(rank, world, port, pp=world)
    try:
        build_bd_groups()
        model = build_two_direction_model(models.provider(tdm.spec(tied=True)))
        names.load_stage_from_full(model[0], {k: torch.from_numpy(v) for k, v in full_state.items()})
        broadcast_mirrors(model)
        for chunk in model:
            chunk.config.finalize_model_grads_func = lambda *a, **k: None
        opt = torch.optim.SGD([p for chunk in model for p in chunk.parameters()], lr=0.1)
        for step in range(3):
            opt.zero_grad()
            forward_backward_dualpipe(forward_step_func=forward_step, model=model, num_microbatches=4,
                                      data_iterator=iter(tdm.spec().batches(4, seed=100 + step)), seq_length=tdm.SEQ,
                                      micro_batch_size=tdm.MBS, p2p_timeout=60, drift_check_every=1)
            opt.step()
        compared = check_copies_identical(model, timeout_s=60)
        if rank == 1:  # the mirror of stage 0: one bit of one weight
            p = dict(model[1].named_parameters())[PARAM]
            with torch.no_grad():
                p.view(-1)[3] = torch.nextafter(p.view(-1)[3], torch.tensor(float("inf")))
        try:
            check_copies_identical(model, timeout_s=60)
            error = None
        except CopiesDriftedError as e:
            error = str(e)
        return compared, error
    finally:
        me.destroy_distributed()


def test_drift_check_passes_in_training_and_names_a_changed_parameter():
    [(state, _, _)] = me.run_workers(tdm._reference_worker, 1, args=(True, 4), timeout=120)
    results = me.run_workers(_worker, 2, args=(state,), timeout=300)
    for r, (compared, error) in enumerate(results):
        print(f"\nrank {r}: {compared} parameters compared after 3 checked training steps; after the bit flip: {error}")
        assert compared > 0
        assert error is not None, f"rank {r} did not see the changed bit"
        for part in ("the two copies of stage 0", f"parameter {PARAM!r}", "global ranks"):
            assert part in error, (part, error)

"""``--defer-embedding-wgrad-compute`` in evaluation: the output layer's buffer stays empty.

With the flag, the output layer's forward appends its input to ``embedding_activation_buffer``
for the deferred weight gradient; in training the chunk's drain empties it, in evaluation
nothing did, so it grew by M entries per evaluation call. pp=2 tiny GPT under dualpipe and
dualpipev, the flag switched on after construction (its weight-gradient path needs APEX's fused
kernel, a GPU; evaluation runs only forwards): after each of two forward-only calls the buffer
is empty, while the forwards did append (counted through a list that records appends).
"""
from __future__ import annotations

import pytest
import torch

import test_dualpipe_megatron as tdm
from harness import megatron_env as me
from megatron_dualpipe.proof import models
from megatron_dualpipe.proof.data import forward_step

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode tests")


class CountingList(list):
    def __init__(self):
        super().__init__()
        self.appended = 0

    def append(self, x):
        self.appended += 1
        super().append(x)


def _worker(rank, world, port, schedule):
    from megatron_dualpipe.mcore.forward_backward import forward_backward_dualpipe
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import build_two_direction_model, unwrap_chunk

    me.init_distributed_cpu(rank, world, port, pp=world)
    try:
        build_bd_groups()
        layout = "v" if schedule == "dualpipev" else "bidirectional"
        model = build_two_direction_model(models.provider(tdm.spec(tied=True), layout == "v"), layout_kind=layout)
        buffers = []
        for chunk in model:
            m = unwrap_chunk(chunk)
            m.config.defer_embedding_wgrad_compute = True
            if m.post_process:
                m.embedding_activation_buffer, m.grad_output_buffer = CountingList(), []
                m.output_layer.embedding_activation_buffer = m.embedding_activation_buffer
                m.output_layer.grad_output_buffer = m.grad_output_buffer
                buffers.append(m.embedding_activation_buffer)
            # With the flag every local ColumnParallelLinear defers (Megatron pairs it with Transformer
            # Engine's layers elsewhere): give the others a list of their own, not looked at.
            for module in m.modules():
                if module is not getattr(m, "output_layer", None) and \
                        hasattr(module, "embedding_activation_buffer") and module.embedding_activation_buffer is None:
                    module.embedding_activation_buffer = []
        after = []
        with torch.no_grad():
            for call in range(2):
                forward_backward_dualpipe(forward_step_func=forward_step, model=model, num_microbatches=4,
                                          data_iterator=iter(tdm.spec().batches(4, seed=call)), seq_length=tdm.SEQ,
                                          micro_batch_size=tdm.MBS, forward_only=True, schedule=schedule,
                                          p2p_timeout=60)
                after.append([len(b) for b in buffers])
        return after, [b.appended for b in buffers]
    finally:
        me.destroy_distributed()


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_evaluation_leaves_no_deferred_activations(schedule):
    results = me.run_workers(_worker, 2, args=(schedule,), timeout=300)
    appended = 0
    for r, (after, counts) in enumerate(results):
        print(f"\n{schedule} rank {r}: buffer sizes after each evaluation call {after}, appends {counts}")
        assert all(n == 0 for sizes in after for n in sizes), after
        appended += sum(counts)
    assert appended == 2 * 4, appended  # every evaluation forward at the output layer appended

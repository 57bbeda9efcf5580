"""The mirror chunks are built as the stage they hold (issue 35, findings 4 and 7).

* The MTP layer's transformer layer on DualPipe's mirror and on DualPipeV's chunk 1 has the number
  Megatron's 1F1B gives it on the last stage (megatron-core 0.16.1 built it without the chunk's
  process groups and numbered it from the physical pipeline rank: 3 and 7 instead of 9), so per-layer
  logging and window-attention patterns are the same on the two copies whose gradients are summed.
* The guard that a chunk holds its stage checks uneven splits too (it checked even splits only):
  a provider that builds the mirror from another stage's process groups is stopped, naming both.
The 1F1B numbers come from megatron-core building each stage of a plain pipeline.
"""
from __future__ import annotations

import pytest

from harness import megatron_env as me

LAYERS = 4


def _mtp_provider(v_layout=False, cache=None, **config):
    """A tiny GPT with one MTP layer built as Megatron-LM's gpt_builders builds it (the MTP block spec
    from the decoder's last layer spec); ``cache``: keep the first pg_collection and use it for every
    later call (a provider bug the guard must catch)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    from megatron_dualpipe.mcore.model import dualpipev_config
    from megatron_dualpipe.proof import tiny_gpt

    def build(pre_process=None, post_process=None, pg_collection=None, vp_stage=None):
        if cache is not None:
            pg_collection = cache.setdefault("pg", pg_collection)
        fields = dict(dict(num_layers=LAYERS), **config)
        cfg = tiny_gpt.tiny_gpt_config(hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, **fields)
        if v_layout:
            cfg = dualpipev_config(cfg)
        spec = get_gpt_layer_local_spec()
        mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False, vp_stage=vp_stage) \
            if cfg.mtp_num_layers else None
        return GPTModel(cfg, spec, vocab_size=64, max_sequence_length=16, pre_process=pre_process,
                        post_process=post_process, mtp_block_spec=mtp, pg_collection=pg_collection,
                        vp_stage=vp_stage)

    return build


def _numbers(chunk):
    """(first decoder layer, the MTP layers' transformer-layer numbers) of a built chunk."""
    layers = chunk.decoder.layers
    inner = [getattr(layer, "transformer_layer", None) or layer.mtp_model_layer  # 0.16.1 / 0.19
             for layer in chunk.mtp.layers] if chunk.mtp_process else []
    mtp = [int(layer.layer_number) for layer in inner]
    return (int(layers[0].layer_number) if len(layers) else None), mtp


def _worker(rank, world, port, schedule, config):
    from megatron.core import parallel_state as ps

    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import build_two_direction_model

    me.init_distributed_cpu(rank, world, port, pp=world)
    try:
        if schedule == "1f1b":
            chunk = _mtp_provider(**config)(pre_process=ps.is_pipeline_first_stage(),
                                           post_process=ps.is_pipeline_last_stage())
            return [_numbers(chunk)]
        build_bd_groups()
        layout = "v" if schedule == "dualpipev" else "bidirectional"
        model = build_two_direction_model(_mtp_provider(layout == "v", **config), layout_kind=layout)
        return [_numbers(c) for c in model]
    finally:
        me.destroy_distributed()


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_the_mtp_layer_is_numbered_as_under_1f1b(schedule):
    config = dict(mtp_num_layers=1)
    ref = me.run_workers(_worker, 2, args=("1f1b", config), timeout=120)
    if schedule == "dualpipev":  # 1F1B over 2 x pp stages: four ranks (megatron-core's last stage)
        ref = me.run_workers(_worker, 4, args=("1f1b", config), timeout=120)
    got = me.run_workers(_worker, 2, args=(schedule, config), timeout=120)
    mtp_1f1b = [m for chunks in ref for _, m in chunks if m]
    mtp_ours = [m for chunks in got for _, m in chunks if m]
    print(f"\nMTP transformer-layer numbers: 1f1b {mtp_1f1b}, {schedule} {mtp_ours}; "
          f"first layers: 1f1b {[c[0][0] for c in ref]}, {schedule} {[[f for f, _ in c] for c in got]}")
    copies = 2 if schedule == "dualpipe" else 1  # DualPipe: the last stage on rank pp-1 and its mirror on rank 0
    assert len(mtp_1f1b) == 1 and mtp_ours == mtp_1f1b * copies


def _guard_worker(rank, world, port, cached):
    from megatron_dualpipe.mcore.groups import build_bd_groups
    from megatron_dualpipe.mcore.model import build_two_direction_model

    me.init_distributed_cpu(rank, world, port, pp=world)
    try:
        build_bd_groups()
        provider = _mtp_provider(cache={} if cached else None, num_layers=5, num_layers_in_first_pipeline_stage=1)
        try:
            return [_numbers(c)[0] for c in build_two_direction_model(provider, layout_kind="bidirectional")]
        except RuntimeError as e:
            return str(e)
    finally:
        me.destroy_distributed()


def test_an_uneven_split_whose_mirror_holds_another_stage_is_refused():
    """5 layers over pp=2, the first stage holding 1: stage 1 starts at layer 2. A provider that
    reuses model[0]'s process groups builds the mirror on rank 0 from stage 0's offset."""
    right = me.run_workers(_guard_worker, 2, args=(False,), timeout=120)
    wrong = me.run_workers(_guard_worker, 2, args=(True,), timeout=120)
    print(f"\nfirst layers per rank (model[0], model[1]): {right}; with model[0]'s groups reused: {wrong}")
    assert right == [[1, 2], [2, 1]]
    assert isinstance(wrong[0], str) and "model[1] should hold stage 1 of 2 (first layer 2)" in wrong[0], wrong

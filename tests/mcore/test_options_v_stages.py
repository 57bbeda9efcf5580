"""The options table's reading of DualPipeV's V-stages under uneven splits."""


def test_the_moe_rule_of_core_016_reads_the_v_stages_an_uneven_split_gives():
    """options' rule for megatron-core 0.16.1 (a last pipeline rank without MoE layers prints an
    unaveraged load_balancing_loss) asks which layers V-stages pp-1 and pp hold: a layout's, or
    Megatron's split with the embedding and the loss counted, not L / 2pp each."""
    from types import SimpleNamespace

    from megatron_dualpipe.mcore.options import _v_stage_sizes

    layout = SimpleNamespace(pipeline_model_parallel_layout="Ett|tt|t|tL")
    counted = SimpleNamespace(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert _v_stage_sizes(layout, 6, 2) == [2, 2, 1, 1]
    assert _v_stage_sizes(counted, 6, 2) == [1, 2, 2, 1]
    assert _v_stage_sizes(SimpleNamespace(), 8, 2) == [2, 2, 2, 2]

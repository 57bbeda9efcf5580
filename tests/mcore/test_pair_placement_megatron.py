"""``--pair-placement`` against megatron-core's own rank groups (``parallel_state.RankGenerator``,
the code ``initialize_model_parallel`` builds every group from): in each pipeline group, ranks i
and pp-1-i share a node, and every tensor-parallel, TP x CP and expert (ETP x EP) group that
Megatron's placement keeps on one node stays on one node. No processes: the generator is pure.
"""
import pytest

from megatron_dualpipe.schedule.placement import DEFAULT_ORDER, TP_PP_DP_ORDER, pair_placement

#: (gpus per node, tp, cp, dp, pp, ep, etp, order)
CASES = [(8, 1, 1, 4, 8, 1, 1, DEFAULT_ORDER), (8, 2, 1, 4, 4, 4, 1, DEFAULT_ORDER),
         (8, 2, 2, 2, 4, 1, 2, DEFAULT_ORDER), (8, 4, 1, 4, 4, 2, 2, DEFAULT_ORDER),
         (16, 8, 1, 2, 8, 1, 8, DEFAULT_ORDER), (8, 1, 1, 8, 2, 4, 1, DEFAULT_ORDER),
         (8, 2, 1, 2, 8, 2, 1, TP_PP_DP_ORDER), (8, 4, 1, 2, 4, 1, 4, TP_PP_DP_ORDER)]


@pytest.mark.parametrize("gpn,tp,cp,dp,pp,ep,etp,order", CASES)
def test_megatrons_groups_under_the_pair_placement(gpn, tp, cp, dp, pp, ep, etp, order):
    from megatron.core.parallel_state import RankGenerator

    world = tp * cp * dp * pp
    decoder = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    perm = pair_placement(world, gpn, tp, cp, dp, pp, order, ep=ep, etp=etp)
    node = {g: slot // gpn for slot, g in enumerate(perm)}
    pipelines = decoder.get_ranks("pp")
    assert pipelines == expert.get_ranks("pp")
    for group in pipelines:
        assert all(node[group[i]] == node[group[pp - 1 - i]] for i in range(pp)), group
    kept, split_before = 0, 0
    for name, groups in (("tp", decoder.get_ranks("tp")), ("tp-cp", decoder.get_ranks("tp-cp")),
                         ("etp-ep", expert.get_ranks("tp-ep"))):
        for group in groups:
            if len({g // gpn for g in group}) == 1:  # on one node in Megatron's placement
                assert len({node[g] for g in group}) == 1, (name, group)
                kept += 1
            else:
                split_before += 1
    print(f"\n{gpn}/node tp={tp} cp={cp} dp={dp} pp={pp} ep={ep} etp={etp} {order}: pipeline groups "
          f"{pipelines[:2]}...; node of each: {[[node[g] for g in p] for p in pipelines[:2]]}; {kept} groups kept on "
          f"their node, {split_before} across nodes already in Megatron's placement")

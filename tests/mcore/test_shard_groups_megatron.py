"""The shared shard groups (``tests/harness/shard_group_ranks.py``) against megatron-core's own groups
(``parallel_state.RankGenerator``, what ``initialize_model_parallel`` builds every group from): the
home half of the group of (rank, chunk) is Megatron's data x context-parallel group of the home
copy, in Megatron's order, the mirror half the same group of the mirror; for expert layers the
expert data-parallel groups of the expert generator. No processes: the generator is pure.
"""
import pytest

from megatron_dualpipe.schedule.placement import DEFAULT_ORDER, TP_PP_DP_ORDER, RankOrder
from harness.shard_group_ranks import expert_order, shared_shard_group, stage_of

#: (tp, cp, dp, pp, ep, etp, order)
CASES = [(1, 1, 2, 4, 1, 1, DEFAULT_ORDER), (2, 1, 2, 4, 2, 1, DEFAULT_ORDER), (2, 2, 2, 4, 1, 2, DEFAULT_ORDER),
         (1, 2, 4, 8, 2, 1, DEFAULT_ORDER), (2, 1, 2, 4, 2, 2, TP_PP_DP_ORDER), (1, 2, 2, 4, 1, 1, TP_PP_DP_ORDER)]


def _group_of(groups, rank):
    return next(g for g in groups if rank in g)


@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp,order", CASES)
def test_halves_are_megatrons_data_parallel_groups(tp, cp, dp, pp, ep, etp, order):
    from megatron.core.parallel_state import RankGenerator

    world = tp * cp * dp * pp
    edp = world // (etp * ep * pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    checks = 0
    for gen, ranks, mask, n in ((dense, RankOrder(tp, cp, dp, pp, order), "dp-cp", dp * cp),
                                (expert, expert_order(etp, ep, edp, pp, order), "dp", edp)):
        groups = gen.get_ranks(mask)
        pipelines = gen.get_ranks("pp")
        for g in range(world):
            line = _group_of(pipelines, g)
            i = line.index(g)
            for c in (0, 1):
                s = stage_of(pp, i, c)
                shared = shared_shard_group(ranks, g, c)
                home, mirror = line[s], line[pp - 1 - s]
                assert list(shared[:n]) == _group_of(groups, home), (mask, g, c, shared)
                assert list(shared[n:]) == _group_of(groups, mirror), (mask, g, c, shared)
                checks += 1
    print(f"\ntp={tp} cp={cp} dp={dp} pp={pp} ep={ep} etp={etp} {order}: {checks} (rank, chunk) groups equal "
          f"Megatron's data-parallel groups of the home copy + the mirror")

"""The shared shard group (``tests/harness/shard_group_ranks.py``): for each (global rank, chunk) of DualPipe,
the ranks that hold either copy of the chunk's stage with the same tensor (and expert) coordinates,
home copy first. Checked against a brute-force search over the world in Megatron's rank order
(a nested loop, tp fastest, independent of ``RankOrder``); ``tests/mcore/test_shard_groups_megatron.py``
checks the same groups against megatron-core's ``RankGenerator``.
"""
import itertools

import pytest

from megatron_dualpipe.schedule.placement import DEFAULT_ORDER, TP_PP_DP_ORDER, RankOrder
from harness.shard_group_ranks import (ShardGroupError, all_shared_shard_groups,
                                                     expert_order, shared_shard_group, stage_of)

#: (tp, cp, ep, dp, pp, order); ep > 1 only as the expert generator (tp = etp, cp = 1).
CASES = [(1, 1, 1, 1, 2, DEFAULT_ORDER), (1, 1, 1, 2, 4, DEFAULT_ORDER), (2, 1, 1, 2, 4, DEFAULT_ORDER),
         (2, 2, 1, 2, 4, DEFAULT_ORDER), (1, 1, 1, 4, 8, DEFAULT_ORDER), (4, 1, 1, 2, 6, DEFAULT_ORDER),
         (2, 1, 1, 2, 4, TP_PP_DP_ORDER), (1, 2, 1, 3, 4, TP_PP_DP_ORDER), (1, 1, 2, 2, 4, DEFAULT_ORDER),
         (2, 1, 2, 2, 4, TP_PP_DP_ORDER)]


def coordinates(tp, cp, ep, dp, pp, order):
    """global rank -> {axis: rank}: Megatron's order enumerated with its first axis fastest."""
    axes = order.split("-")
    sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
    return {g: dict(zip(reversed(axes), values))
            for g, values in enumerate(itertools.product(*(range(sizes[a]) for a in reversed(axes))))}


def brute_force(coords, pp, g, c):
    """Every rank holding a copy of (g, c)'s stage with g's tensor/expert coordinates: (home, mirror)."""
    me = coords[g]
    stage = me["pp"] if c == 0 else pp - 1 - me["pp"]
    same = [h for h, x in coords.items() if x["tp"] == me["tp"] and x["ep"] == me["ep"]]
    home = {h for h in same if coords[h]["pp"] == stage}            # its model[0] is the stage
    mirror = {h for h in same if pp - 1 - coords[h]["pp"] == stage}  # its model[1] is the stage
    return home, mirror


def _order(tp, cp, ep, dp, pp, order):
    return RankOrder(tp, cp, dp, pp, order, ep=ep)


@pytest.mark.parametrize("tp,cp,ep,dp,pp,order", CASES)
def test_groups_match_brute_force(tp, cp, ep, dp, pp, order):
    ranks = _order(tp, cp, ep, dp, pp, order)
    coords = coordinates(tp, cp, ep, dp, pp, order)
    for g in range(ranks.world):
        assert ranks.coords(g) == coords[g]
        for c in (0, 1):
            group = shared_shard_group(ranks, g, c)
            home, mirror = brute_force(coords, pp, g, c)
            n = dp * cp
            assert len(group) == 2 * n == len(set(group)), group
            assert set(group[:n]) == home and set(group[n:]) == mirror, (g, c, group, home, mirror)
            assert list(group[:n]) == sorted(home) and list(group[n:]) == sorted(mirror)
            assert g in group
            # group rank 0: the home copy's first data-parallel rank (Megatron's writer and broadcaster)
            assert coords[group[0]]["pp"] == stage_of(pp, coords[g]["pp"], c) and coords[group[0]]["dp"] == 0
    groups = all_shared_shard_groups(ranks)
    members = sorted(r for grp in groups for r in grp)
    # each rank is in exactly two groups (its two chunks), each group counted once
    assert members == sorted(list(range(ranks.world)) * 2)
    assert len(groups) == ranks.world // (dp * cp)
    print(f"\ntp={tp} cp={cp} ep={ep} dp={dp} pp={pp} {order}: {len(groups)} groups; rank 0: chunk 0 "
          f"{shared_shard_group(ranks, 0, 0)}, chunk 1 {shared_shard_group(ranks, 0, 1)}")


@pytest.mark.parametrize("tp,cp,ep,dp,pp,order", CASES)
def test_a_rank_and_its_partner_share_both_groups(tp, cp, ep, dp, pp, order):
    """Chunk c of rank r and chunk 1-c of its partner (pipeline rank pp-1-r, same other
    coordinates) are one group; a rank's two groups span the same ranks in different orders."""
    ranks = _order(tp, cp, ep, dp, pp, order)
    for g in range(ranks.world):
        x = ranks.coords(g)
        partner = ranks.global_rank(**{**x, "pp": pp - 1 - x["pp"]})
        for c in (0, 1):
            assert shared_shard_group(ranks, g, c) == shared_shard_group(ranks, partner, 1 - c)
        a, b = shared_shard_group(ranks, g, 0), shared_shard_group(ranks, g, 1)
        assert set(a) == set(b) and a != b


def test_expert_order_is_megatrons_expert_generator_shape():
    ranks = expert_order(etp=2, ep=2, edp=2, pp=4)
    assert ranks.world == 32 and ranks.sizes == {"tp": 2, "cp": 1, "ep": 2, "dp": 2, "pp": 4}
    assert len(shared_shard_group(ranks, 5, 1)) == 4


def test_refusals_name_the_fix():
    with pytest.raises(ShardGroupError, match="even pipeline size"):
        shared_shard_group(RankOrder(1, 1, 2, 3), 0, 0)
    with pytest.raises(ShardGroupError, match="outside the world"):
        shared_shard_group(RankOrder(1, 1, 2, 4), 8, 0)
    with pytest.raises(ShardGroupError, match="chunks 0 and 1"):
        shared_shard_group(RankOrder(1, 1, 2, 4), 0, 2)

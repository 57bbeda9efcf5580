"""The bd pairs side by side (``schedule/placement.py``, what the launcher's ``--pair-placement``
applies): a permutation of Megatron's global ranks under which every node holds complete bd pairs,
Megatron's fastest groups stay on a node, and what cannot be done is refused naming the fix.

The reference for "which global rank has which coordinates" here is a plain nested loop in
Megatron's order (tp fastest); ``tests/mcore/test_pair_placement_megatron.py`` checks the same
properties against megatron-core's own ``RankGenerator``.
"""
import itertools

import pytest

from megatron_dualpipe.schedule.placement import (DEFAULT_ORDER, TP_PP_DP_ORDER, PlacementError, invert,
                                                  pair_placement, pair_problem)

#: (gpus per node, tp, cp, dp, pp, order): the seed's 1.3B case, small and large stages, both orders.
CASES = [(8, 1, 1, 4, 8, DEFAULT_ORDER), (8, 2, 1, 4, 8, DEFAULT_ORDER), (8, 4, 1, 2, 16, DEFAULT_ORDER),
         (8, 1, 1, 1, 8, DEFAULT_ORDER), (16, 8, 1, 2, 16, DEFAULT_ORDER), (8, 2, 2, 2, 4, DEFAULT_ORDER),
         (4, 1, 1, 8, 4, DEFAULT_ORDER), (2, 1, 1, 1, 4, DEFAULT_ORDER), (8, 2, 1, 4, 8, TP_PP_DP_ORDER),
         (8, 1, 1, 2, 8, TP_PP_DP_ORDER), (8, 4, 1, 2, 4, TP_PP_DP_ORDER)]


def coordinates(tp, cp, dp, pp, order):
    """global rank -> {axis: rank}, by enumerating Megatron's order with the first axis fastest."""
    axes = order.split("-")
    sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    out = {}
    for g, values in enumerate(itertools.product(*(range(sizes[a]) for a in reversed(axes)))):
        out[g] = dict(zip(reversed(axes), values))
    return out


@pytest.mark.parametrize("gpn,tp,cp,dp,pp,order", CASES)
def test_every_node_holds_complete_bd_pairs(gpn, tp, cp, dp, pp, order):
    world = tp * cp * dp * pp
    perm = pair_placement(world, gpn, tp, cp, dp, pp, order)
    assert sorted(perm) == list(range(world)) and perm[0] == 0
    coords = coordinates(tp, cp, dp, pp, order)
    node = {g: slot // gpn for slot, g in enumerate(perm)}
    by_coords = {tuple(sorted(c.items())): g for g, c in coords.items()}
    partner_of = {g: by_coords[tuple(sorted(dict(c, pp=pp - 1 - c["pp"]).items()))] for g, c in coords.items()}
    for g in coords:
        assert node[g] == node[partner_of[g]], (g, partner_of[g])
    # the tensor-parallel (and tp x cp) groups Megatron's placement keeps on a node stay on one
    for axes in (("tp",), ("tp", "cp")):
        groups = {}
        for g, c in coords.items():
            groups.setdefault(tuple(v for a, v in sorted(c.items()) if a not in axes), []).append(g)
        for ranks in groups.values():
            if len({r // gpn for r in ranks}) == 1:
                assert len({node[r] for r in ranks}) == 1, (axes, ranks)
    # how many ranks Megatron's own placement keeps apart from their partner (printed)
    apart = sum(1 for g in coords if g // gpn != partner_of[g] // gpn)
    stages = [sorted({coords[g]["pp"] for g in perm[n * gpn:(n + 1) * gpn]}) for n in range(world // gpn)]
    print(f"\n{gpn}/node tp={tp} cp={cp} dp={dp} pp={pp} {order}: nodes hold pipeline ranks {stages[:4]}"
          f"{' ...' if len(stages) > 4 else ''}; Megatron's placement has {apart}/{world} ranks apart from their "
          f"partner")
    assert invert(perm)[perm[5 % world]] == 5 % world


@pytest.mark.parametrize("args,words", [
    ((28, 4, 1, 1, 4, 7), "even pipeline size"),
    ((256, 8, 8, 1, 2, 16), "split the tensor-parallel groups of 8"),
    ((48, 8, 1, 1, 6, 8), "not a multiple of half a node"),
    ((36, 3, 1, 1, 3, 12), "even GPU count"),
    ((60, 12, 1, 1, 5, 12), "a bd pair spans 2x5 ranks"),
    ((32, 8, 1, 1, 4, 9), "world size 32 is not tp*cp*dp*pp"),
    ((30, 8, 1, 1, 3, 10), "do not fill nodes of 8"),
])
def test_what_cannot_be_placed_is_refused_naming_the_fix(args, words):
    problem = pair_problem(*args)
    print(f"\n{args}: {problem}")
    assert problem and words in problem
    with pytest.raises(PlacementError, match="drop --pair-placement|multiple|positive|not tp"):
        pair_placement(*args)


def test_expert_groups_that_fit_a_node_are_not_split():
    # tp=1, 8 GPUs per node: a stage of 8 dp ranks is split in halves of 4; expert-parallel groups of 8 would split
    problem = pair_problem(64, 8, 1, 1, 8, 8, ep=8)
    assert problem and "expert tensor x expert parallel groups of 8" in problem
    assert pair_problem(64, 8, 1, 1, 8, 8, ep=4) is None

"""``iteration_plan.issued``: whether the ranks issue their collectives in an order NCCL can
complete (per communicator: the same sequence on every member; per rank: one stream), proven by
the iteration plan's own check (``check(..., one_queue=True)``).

The case it exists for is DualPipe's shared shard group (``tests/harness/shard_group_ranks.py``): chunk c of
rank r and chunk 1-c of rank pp-1-r are one group, so every rank's two chunks reduce-scatter over
two groups spanning the same ranks. Megatron's own loop (``for chunk in model:
chunk.finish_grad_sync()``; the optimizer's ``start_param_sync`` per chunk) issues chunk 0 first on
every rank, which is stage i first on rank i and stage pp-1-i first on its partner: the check must
find that, with one communicator per stage (a stream deadlock) and with one communicator per pair
of ranks (a mismatch NCCL would pair silently). The orders the design picks pass: the iteration
program's bd-sum order (``lowering.reductions.bd_sum_order``) for the reduce-scatters issued during the
schedule, ascending stage (``copy_sum.stage_order``) for the all-gathers after the step.
"""
import functools

import pytest

from megatron_dualpipe.schedule import build_schedule
from megatron_dualpipe.schedule import iteration_plan as IP
from megatron_dualpipe.schedule.iteration_plan import Collective
from megatron_dualpipe.schedule.lowering.reductions import bd_sum_order, grad_ops
from megatron_dualpipe.schedule.placement import RankOrder
from megatron_dualpipe.schedule.copy_sum import stage_order
from megatron_dualpipe.schedule.layout import BIDIRECTIONAL, Layout
from harness.shard_group_ranks import shard_collectives

#: (tp, dp, pp, micro-batches, zero bubble, buckets per chunk)
CASES = [(1, 1, 2, 4, False, 1), (1, 2, 4, 8, False, 2), (2, 2, 4, 10, True, 2), (1, 2, 8, 16, True, 3),
         (1, 4, 6, 12, False, 1)]


def order_problem(collectives, communicator=lambda c: c.group):
    """The check's error for what the ranks issued, or None."""
    try:
        IP.check(IP.issued(collectives, communicator), one_queue=True)
    except IP.IterationPlanError as e:
        return str(e)
    return None


def one_communicator_per_rank_set(c: Collective):
    """The alternative design: both stages of a pair on one communicator over the same ranks."""
    return frozenset(c.group)


def issues(ranks: RankOrder, chunk_order, buckets):
    """Per global rank: its (chunk, bucket) collectives, chunks in ``chunk_order(pp_rank)``."""
    return {g: [(c, b) for c in chunk_order(ranks.pp_rank(g)) for b in range(buckets)] for g in range(ranks.world)}


def plan_order(pp, m, zero_bubble):
    """The chunks of each pipeline rank in the iteration plan's bd-sum order (both partners alike)."""
    s = build_schedule("dualpipe", pp, m)
    ops = grad_ops(zero_bubble)
    orders = [bd_sum_order(s.ranks[r], s.ranks[pp - 1 - r], lambda a: False, ops, lower_rank=r < pp - 1 - r)
              for r in range(pp)]
    return lambda r: orders[r]


@pytest.mark.parametrize("tp,dp,pp,m,zb,nb", CASES)
def test_megatrons_per_chunk_order_breaks_both_designs(tp, dp, pp, m, zb, nb):
    ranks = RankOrder(tp, 1, dp, pp)
    naive = shard_collectives(ranks, issues(ranks, lambda r: [0, 1], nb))
    per_stage = order_problem(naive)
    per_pair = order_problem(naive, one_communicator_per_rank_set)
    print(f"\ntp={tp} dp={dp} pp={pp}, chunk 0 first on every rank:\n  one communicator per stage: {per_stage}"
          f"\n  one communicator per pair of ranks: {per_pair}")
    assert per_stage is not None and "deadlocks under NCCL stream semantics" in per_stage and "again" in per_stage
    assert per_pair is not None and "is not the same on every rank" in per_pair
    # the collectives named are ones the ranks issued
    for p in (per_stage, per_pair):
        assert any(f"rank {r}'s {c}" in p for r, cs in naive.items() for c in cs), p


@pytest.mark.parametrize("tp,dp,pp,m,zb,nb", CASES)
def test_the_plans_order_and_stage_order_pass(tp, dp, pp, m, zb, nb):
    ranks = RankOrder(tp, 1, dp, pp)
    order = plan_order(pp, m, zb)
    reduce_scatters = shard_collectives(ranks, issues(ranks, order, nb))
    by_stage = functools.partial(stage_order, Layout(BIDIRECTIONAL, pp))
    all_gathers = shard_collectives(ranks, issues(ranks, by_stage, nb), kind="all-gather")
    print(f"\ntp={tp} dp={dp} pp={pp} M={m} zb={zb}: reduce-scatter chunk order per pp rank "
          f"{[order(r) for r in range(pp)]}, all-gather {[by_stage(r) for r in range(pp)]}")
    for lists in (reduce_scatters, all_gathers):
        assert order_problem(lists) is None
        assert order_problem(lists, one_communicator_per_rank_set) is None
    # one iteration: the reduce-scatters, then (after the step) the all-gathers, on one stream per rank
    both = {g: reduce_scatters[g] + all_gathers[g] for g in reduce_scatters}
    assert order_problem(both) is None


def test_a_cycle_over_three_ranks_is_found_though_every_pair_agrees():
    """a: X then Y; b: Y then Z; c: Z then X, with X={a,c}, Y={a,b}, Z={b,c}: any two ranks issue
    their common collectives in the same order, and still nothing can start."""
    x, y, z = Collective((0, 2), "X"), Collective((0, 1), "Y"), Collective((1, 2), "Z")
    p = order_problem({0: [x, y], 1: [y, z], 2: [z, x]})
    print(f"\n{p}")
    assert p is not None and "deadlocks under NCCL stream semantics" in p
    assert all(f"rank {r}'s" in p for r in (0, 1, 2)) and "again" in p
    assert order_problem({0: [x, y], 1: [y, z], 2: [x, z]}) is None


def test_missing_and_foreign_collectives_are_named():
    x = Collective((0, 1), "X")
    p = order_problem({0: [x, x], 1: [x]})
    assert p is not None and "rank 1 issues no collective 1 there" in p, p
    p = order_problem({0: [x], 1: [x], 2: [x]})
    assert p is not None and "rank 2 is not one of its ranks" in p, p


def dp_first(ranks: RankOrder, chunk_order, buckets):
    """dp-first (Megatron's partial distributed optimizer with the bd pair as the inter group): per
    chunk and bucket a reduce-scatter over the copy's own data-parallel replicas, then the pair's
    all-reduce of the shard (partners with the same data/tensor coordinates)."""
    from harness.shard_group_ranks import stage_of

    out = {}
    for g in range(ranks.world):
        x = ranks.coords(g)
        partner = ranks.global_rank(**{**x, "pp": ranks.pp - 1 - x["pp"]})
        replicas = tuple(sorted(ranks.global_rank(**{**x, "dp": d}) for d in range(ranks.dp)))
        pair = tuple(sorted((g, partner)))
        lst = []
        for c in chunk_order(x["pp"]):
            s = stage_of(ranks.pp, x["pp"], c)
            for b in range(buckets):
                lst += [Collective(replicas, ("reduce-scatter", s, b)), Collective(pair, ("pair sum", s, b))]
        out[g] = lst
    return out


@pytest.mark.parametrize("tp,dp,pp,m,zb,nb", CASES[1:])
def test_dp_first_needs_the_plans_order_too(tp, dp, pp, m, zb, nb):
    """The reduce-scatter over a rank's replicas is one communicator for both its chunks (as today),
    the pair sum one communicator per pair (today's bd group): Megatron's chunk order mismatches on
    the pair's communicator, the plan's order passes."""
    ranks = RankOrder(tp, 1, dp, pp)
    naive = order_problem(dp_first(ranks, lambda r: [0, 1], nb))
    print(f"\ntp={tp} dp={dp} pp={pp} dp-first, chunk 0 first: {naive}")
    assert naive is not None and "pair sum" in naive
    assert order_problem(dp_first(ranks, plan_order(pp, m, zb), nb)) is None

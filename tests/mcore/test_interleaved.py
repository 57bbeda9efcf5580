"""Megatron's interleaved 1F1B as data: the generator against megatron-core's own schedule.

The reference is the installed megatron-core: its schedule table (``get_schedule_table``: which
micro-batch and model chunk the k-th forward runs) and its warm-up count
(``get_pp_rank_microbatches``), read through ``forward_backward_pipelining_with_interleaving``'s
loop (warm-up forwards, steady forward + backward, cool-down backwards; the k-th backward runs the
table's k-th entry in the mirrored chunk). The simulator then gives the known bubble
(pp-1)(f+b)/v with stage costs f, b.
"""
from types import SimpleNamespace

import pytest

from megatron_dualpipe.schedule.actions import BW, F
from megatron_dualpipe.schedule.registry import (INTERLEAVED_1F1B, INTERLEAVED_1F1B_A2A, NAMES, ScheduleError,
                                                 build_schedule, get, interleaved_name, spec)
from megatron_dualpipe.schedule.simulate import Costs, simulate

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


def megatron_order(pp, rank, m, v, overlap=False):
    """[(op, chunk, micro-batch)] in the order megatron-core's interleaved loop runs them."""
    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                           virtual_pipeline_model_parallel_size=v)
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
        m, v, pp, forward_only=False, overlap_moe_expert_parallel_comm=overlap, p2p_communicator=comm)
    table = schedules.get_schedule_table(m, v, pp)

    def fwd(k):
        mb, c = table[k]
        return (F, c, mb)

    def bwd(k):
        mb, c = table[k]
        return (BW, v - 1 - c, mb)

    order = [fwd(k) for k in range(warmup)]
    for k in range(remaining):
        order += [fwd(k + warmup), bwd(k)]
    order += [bwd(k) for k in range(remaining, total)]
    return order


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3), (8, 16, 2), (8, 8, 4)])
def test_order_is_megatrons(pp, m, v, overlap):
    name = interleaved_name(INTERLEAVED_1F1B_A2A if overlap else INTERLEAVED_1F1B, v)
    s = build_schedule(name, pp, m)
    for r, acts in enumerate(s.ranks):
        mine = [(a.op, a.dir, a.mb) for a in acts]
        assert mine == megatron_order(pp, r, m, v, overlap), (name, pp, m, r)
        # Megatron's layer placement: chunk c of rank r is virtual stage c*pp + r.
        assert all(a.stage == a.dir * pp + r for a in acts)
        # The EP all-to-all overlap fuses every steady step (one F and the backward after it).
        fused = sum(a.overlap for a in acts)
        assert fused == (sum(1 for a in acts if a.op == F) - megatron_warmup(pp, r, m, v, overlap) if overlap else 0)
    print(f"\n{name} pp={pp} M={m}: rank 0 = {' '.join(map(str, s.ranks[0]))}")


def megatron_warmup(pp, rank, m, v, overlap):
    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                           virtual_pipeline_model_parallel_size=v)
    return schedules.get_pp_rank_microbatches(m, v, pp, overlap_moe_expert_parallel_comm=overlap,
                                              p2p_communicator=comm)[2]


@pytest.mark.parametrize("pp,m,v", [(4, 8, 2), (4, 16, 4), (8, 16, 2), (8, 32, 2)])
def test_bubble_is_the_known_one(pp, m, v):
    """Stage costs f=1, b=2 cut into v chunks: makespan M(f+b) + (pp-1)(f+b)/v (Narayanan et al. 2021)."""
    s = build_schedule(interleaved_name(INTERLEAVED_1F1B, v), pp, m)
    res = simulate(s.layout, s.ranks, Costs(f=1 / v, b=2 / v, w=1 / v))
    want = m * 3 + (pp - 1) * 3 / v
    print(f"\npp={pp} M={m} v={v}: simulated {res.makespan}, closed form {want}")
    assert res.makespan == pytest.approx(want)


def test_not_a_pipeline_schedule_choice():
    """Megatron runs it as 1f1b with a virtual pipeline: the registry lists it for comparisons only."""
    assert INTERLEAVED_1F1B not in NAMES and INTERLEAVED_1F1B_A2A not in NAMES
    with pytest.raises(ScheduleError, match="simulated only.*virtual-pipeline-model-parallel-size"):
        get(INTERLEAVED_1F1B)
    with pytest.raises(ScheduleError, match="multiple of pp=4"):
        build_schedule(INTERLEAVED_1F1B, 4, 6)
    with pytest.raises(ScheduleError, match="multiple of pp=4"):
        spec(INTERLEAVED_1F1B).padded_microbatches(4, 6)
    assert spec("interleaved-1f1b-v3").chunks_per_rank == 3

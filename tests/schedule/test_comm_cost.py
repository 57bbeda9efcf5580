"""The gradient communication in the iteration: the seed's sign flip, the timing of the bd sums
against the simulated timelines, the rank placement, and advise never picking a slower schedule.

Seed 002 (docs/seeds, section 2.4) measured DualPipe about 1 s per iteration *slower* than 1F1B on
32 GPUs with a small model ("the extra gradient all-reduce of the two-direction model became the
bottleneck") and ahead of it on 256 GPUs with a large one. The stated inputs below are one
H800-class cluster for both: 400 TFLOP/s sustained per GPU (989 peak at 40%), 8 GPUs per node,
200 GB/s per GPU inside a node, 25 GB/s per GPU between nodes, fp32 main gradients; a 1.3B GPT
(hidden 2048, 2048 tokens per micro-batch) at pp=8, dp=4 (32 GPUs), M=20; a 70B GPT (hidden
8192, 4096 tokens per micro-batch) at pp=16, tp=8, dp=2 (256 GPUs), M=40.
"""
import random

import pytest

from megatron_dualpipe.costs.advice import DenseModel, advise
from megatron_dualpipe.costs.comm_cost import (CommModel, Link, Network, Placement, all_reduce_ms, grad_comm,
                                                  reduce_scatter_ms)
from megatron_dualpipe.costs.compare import build_padded, run
from megatron_dualpipe.schedule.copy_sum import BD_FIRST, DP_FIRST, SHARED_SHARD
from megatron_dualpipe.schedule.placement import PlacementError
from megatron_dualpipe.schedule.registry import DUALPIPE, DUALPIPEV, INTERLEAVED_1F1B, ONE_F_ONE_B, ZB_H1
from megatron_dualpipe.schedule.simulate import Costs, simulate

H800 = Network(intra=Link(200, 0.01), inter=Link(25, 0.02))
SMALL = dict(model=DenseModel(1.3e9, 2048, 2048, pp=8, tflops=400), dp=4, tp=1, m=20)
LARGE = dict(model=DenseModel(70e9, 8192, 4096, pp=16, tflops=400, tp=8), dp=2, tp=8, m=40)


def case(c, network=H800):
    d = c["model"]
    comm = CommModel(Placement(d.pp, c["dp"], c["tp"]), network, d.stage_grad_bytes, d.message_bytes)
    return d, comm


@pytest.mark.parametrize("label,c,ahead", [("1.3B, 32 GPUs", SMALL, ONE_F_ONE_B), ("70B, 256 GPUs", LARGE, DUALPIPE)])
def test_seed_sign_flip(label, c, ahead):
    d, comm = case(c)
    rows = {n: run(n, d.pp, c["m"], d.costs, comm=comm) for n in (ONE_F_ONE_B, DUALPIPE)}
    bare = {n: run(n, d.pp, c["m"], d.costs) for n in (ONE_F_ONE_B, DUALPIPE)}
    print(f"\n{label}: stage costs {d.costs}, gradients {d.stage_grad_bytes / 1e6:.0f} MB per stage")
    for n, r in rows.items():
        print(f"  {n:>9}: makespan {r.makespan:8.1f} + exposed {r.exposed:6.1f} = {r.iteration:8.1f} ms "
              f"(bd sums {max(r.grad.bd_total):.1f}, dp {max(r.grad.dp_total):.1f} per rank; without any "
              f"communication {bare[n].makespan:.1f})")
    # Without the communication DualPipe is ahead in both: the flip is the gradient communication's.
    assert bare[DUALPIPE].makespan < bare[ONE_F_ONE_B].makespan
    other = DUALPIPE if ahead == ONE_F_ONE_B else ONE_F_ONE_B
    assert rows[ahead].iteration < rows[other].iteration
    a = advise(d.pp, [c["m"]], d.costs, 1, 1, names=[ONE_F_ONE_B, DUALPIPE], comm=comm, tokens=d.tokens)
    print(f"  advise: {a.choices[0].reason}")
    assert a.choices[0].best == ahead
    # The break-even bandwidth it prints: just below and above it, the two swap places.
    even = a.choices[0].break_even
    assert even.rival == other and even.bandwidth is not None

    def lead(bw):
        c2 = comm.with_inter_bandwidth(bw)
        return run(ahead, d.pp, c["m"], d.costs, comm=c2).iteration - run(other, d.pp, c["m"], d.costs, comm=c2).iteration
    assert (lead(even.bandwidth * 0.98) < 0) != (lead(even.bandwidth * 1.02) < 0)


def test_bd_sums_start_when_both_copies_are_final():
    """Recomputed from the simulated timelines alone: a pair's first sum starts when the later
    partner's copy is final, the second when both copies are final and the first is done."""
    d, comm = case(SMALL)
    padded = build_padded(DUALPIPE, 8, 20)
    s = padded.schedule
    res = simulate(s.layout, s.ranks, d.costs)
    g = grad_comm(s, res, comm, 1.0, True)
    one = all_reduce_ms(d.stage_grad_bytes, 2, H800.inter)  # ranks i and 7-i: nodes i//2 and (7-i)//2
    for r in range(4):
        p = 7 - r
        last = lambda rank, c: max(e for a, e in zip(s.ranks[rank], res.ranks[rank].ends)  # noqa: E731
                                   if a.dir == c and a.op in ("W", "BW"))
        ready = sorted((max(last(r, c), last(p, 1 - c)), c) for c in (0, 1))
        first = ready[0][0]
        second = max(ready[1][0], first + one)
        got = sorted((x.bd_start, x.chunk) for x in g.ranks[r])
        print(f"rank {r}/{p}: copies final at {[round(t, 1) for t, _ in ready]}, sums start "
              f"{[round(t, 1) for t, _ in got]} (each {one:.1f} ms), makespan {res.makespan:.1f}")
        assert [t for t, _ in got] == pytest.approx([first, second])
        # every data-parallel reduction starts after its chunk's sum
        assert all(x.dp_start >= x.bd_end - 1e-9 for x in g.ranks[r])


def test_paired_placement_keeps_the_bd_sums_inside_a_node():
    """The launcher's --pair-placement (the same function) on the 1.3B case: every bd pair and every
    data-parallel group inside one node; on the 70B case (tp=8 fills a node) it is refused."""
    d, comm = case(SMALL)
    paired = comm.with_placement(True)
    for r in range(8):
        assert comm.placement.pp_ranks_cross_nodes(r, 7 - r)          # Megatron's order: pp is outermost
        assert not paired.placement.pp_ranks_cross_nodes(r, 7 - r)    # 0,7 | 1,6 | ... on one node each
        assert not paired.placement.dp_group_crosses_nodes(r)
    plain, side = (run(DUALPIPE, 8, 20, d.costs, comm=c) for c in (comm, paired))
    print(f"\ndualpipe 1.3B: exposed {plain.exposed:.1f} ms (Megatron placement), {side.exposed:.1f} ms (paired)")
    assert side.exposed < plain.exposed
    # schedules without bd pairs keep Megatron's placement (the launcher refuses to pair them)
    one = [run(ONE_F_ONE_B, 8, 20, d.costs, comm=c).iteration for c in (comm, paired)]
    assert one[0] == one[1]
    _, big = case(LARGE)
    with pytest.raises(PlacementError, match="split the tensor-parallel groups of 8"):
        big.with_placement(True)


def test_advise_never_picks_a_slower_schedule():
    rnd = random.Random(18)
    for _ in range(12):
        pp = rnd.choice([4, 8])
        m = pp * rnd.choice([2, 3, 4])
        f = rnd.uniform(0.5, 20)
        costs = Costs(f=f, b=2 * f, w=rnd.uniform(0.2, 1.0) * f)
        comm = CommModel(Placement(pp, rnd.choice([1, 2, 8]), 1), Network(Link(200, 0.01), Link(rnd.uniform(5, 50), 0.02)),
                         rnd.uniform(1e7, 2e9), rnd.uniform(0, 2e7))
        a = advise(pp, [m], costs, 1.0, rnd.uniform(0, 10), comm=comm,
                   names=[ONE_F_ONE_B, ZB_H1, DUALPIPE, DUALPIPEV, INTERLEAVED_1F1B])
        ch = a.choices[0]
        ok = [o.row for o in ch.options if not o.row.problem]
        fastest = min(r.iteration for r in ok)
        best = next(r for r in ok if r.name == ch.best)
        print(f"pp={pp} M={m} f={f:.1f}: {ch.best} {best.iteration:.1f} (fastest {fastest:.1f})")
        assert best.iteration == fastest


@pytest.mark.parametrize("label,c", [("1.3B, 32 GPUs", SMALL), ("70B, 256 GPUs", LARGE)])
def test_what_each_variant_of_item_4_buys(label, c):
    """With the distributed optimizer: the executor's bd-first reduction, dp-first (the pair sums
    1/dp shards), and one shard group of 2 x dp (a single reduce-scatter per stage), with Megatron's
    and the mirrored rank placement. The shared shard group moves no more bytes than bd-first in
    any placement: (2dp-1)/2dp of a stage, against 1 + (dp-1)/dp."""
    d = c["model"]
    base = run(ONE_F_ONE_B, d.pp, c["m"], d.costs,
               comm=CommModel(Placement(d.pp, c["dp"], c["tp"]), H800, d.stage_grad_bytes, d.message_bytes,
                              distributed_optimizer=True))
    print(f"\n{label}: 1f1b iteration {base.iteration:.1f} ms (exposed {base.exposed:.1f})")
    got = {}
    for paired in (False, True):
        for mode in (BD_FIRST, DP_FIRST, SHARED_SHARD):
            try:
                comm = CommModel(Placement(d.pp, c["dp"], c["tp"], paired=paired), H800, d.stage_grad_bytes,
                                 d.message_bytes, distributed_optimizer=True, bd_mode=mode)
            except PlacementError as e:
                print(f"  paired placement refused: {e}")
                break
            r = run(DUALPIPE, d.pp, c["m"], d.costs, comm=comm)
            got[(paired, mode)] = r.iteration
            print(f"  dualpipe {mode:>12} {'paired' if paired else 'megatron':>8}: makespan {r.makespan:.1f} + "
                  f"exposed {r.exposed:.1f} = {r.iteration:.1f} ms ({r.iteration / base.iteration:.3f} x 1f1b)")
    for paired in (False, True):
        if (paired, SHARED_SHARD) in got:
            assert got[(paired, SHARED_SHARD)] <= got[(paired, BD_FIRST)] + 1e-9
    assert all(got[(True, m)] <= got[(False, m)] + 1e-9 for m in (BD_FIRST, DP_FIRST, SHARED_SHARD) if (True, m) in got)
    # the cost of one step, independently: a ring reduce-scatter over 2dp ranks on the inter-node link
    assert reduce_scatter_ms(d.stage_grad_bytes, 2 * c["dp"], H800.inter) < \
        all_reduce_ms(d.stage_grad_bytes, 2, H800.inter) + reduce_scatter_ms(d.stage_grad_bytes, c["dp"], H800.inter)

"""schedule.lowering.reductions: when a chunk's gradients are final, and the order a bd pair sums them.

Both partners of a pair must issue their two sums in the same order of *stages* (the partner's
chunk 1-c is this rank's chunk c), or their collectives would add unrelated gradients. Checked
for every DualPipe rank pair over pipeline sizes and micro-batch counts, with and without
deferred weight gradients, against the action lists themselves (the last gradient action of
each chunk found by a plain scan here).
"""
import pytest

from megatron_dualpipe.schedule import build_schedule, registry
from megatron_dualpipe.schedule.lowering.reductions import bd_sum_order, completion_order, grad_ops, last_grad_action_index


def _strip_w(actions):
    """The same order without zero bubble: each W folded into its B (as BW)."""
    from dataclasses import replace
    return [replace(a, op="BW") if a.op == "B" else a for a in actions if a.op != "W"]


@pytest.mark.parametrize("deferring", [True, False])
@pytest.mark.parametrize("pp,m", [(2, 3), (2, 4), (4, 5), (4, 8), (4, 10), (6, 12), (8, 9), (8, 16), (8, 20)])
def test_partners_agree_on_the_order_of_stages(pp, m, deferring):
    """``m`` real micro-batches, padded with fake ones as the executor does (M < 2pp or odd)."""
    spec = registry.get(registry.DUALPIPE)
    s = build_schedule(spec.name, pp, spec.padded_microbatches(pp, m))

    def is_fake(a):
        return spec.is_fake(m, a.dir, a.mb)

    ranks = [list(acts) if deferring else _strip_w(acts) for acts in s.ranks]
    ops = grad_ops(deferring)
    differing = 0
    for r in range(pp // 2):
        p = pp - 1 - r
        mine = bd_sum_order(ranks[r], ranks[p], is_fake, ops, lower_rank=True)
        theirs = bd_sum_order(ranks[p], ranks[r], is_fake, ops, lower_rank=False)
        assert theirs == [1 - c for c in mine], (r, mine, theirs)
        natural = completion_order(ranks[p], is_fake, ops)
        differing += natural != theirs
        for k, acts in ((r, ranks[r]), (p, ranks[p])):
            last = last_grad_action_index(acts, is_fake, ops)
            for c in (0, 1):
                scan = [a for a in acts if a.dir == c and a.op in ops and not is_fake(a)][-1]
                assert acts[last[c]] == scan, (k, c)
    print(f"pp={pp} M={m} deferring={deferring}: {pp // 2} pairs agree; {differing} needed the lower rank's order")

"""``mcore.comm_probe``: the link fitted from two timed sizes is the link that produced them.

The timings are made here from known links with the ring cost model of ``costs.comm_cost``
(all-reduce over n ranks, one P2P message), independently of the probe's own arithmetic.
"""
import pytest

from megatron_dualpipe.mcore.comm_probe import LARGE, SMALL, _fit
from megatron_dualpipe.costs.comm_cost import Link, all_reduce_ms, p2p_ms


@pytest.mark.parametrize("bandwidth,latency", [(0.3, 2.0), (25.0, 0.02), (200.0, 0.005)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_fit_recovers_the_link(bandwidth, latency, n):
    link = Link(bandwidth, latency)
    small, large = all_reduce_ms(SMALL, n, link), all_reduce_ms(LARGE, n, link)
    got = _fit(small, large, 2 * (n - 1) / n)
    per_message = got.latency / (2 * (n - 1))  # what all_reduce_link reports
    print(f"n={n}: {small:.4f} / {large:.4f} ms -> {got.bandwidth:.4f} GB/s + {per_message:.5f} ms per message")
    assert got.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert per_message == pytest.approx(latency, rel=1e-6, abs=1e-9)


def test_p2p_fit_recovers_the_link():
    link = Link(12.5, 0.3)
    got = _fit(p2p_ms(SMALL, link), p2p_ms(LARGE, link), 1.0)
    assert (got.bandwidth, got.latency) == pytest.approx((12.5, 0.3))

"""The default way of summing a DualPipe stage's two copies: the bd sum.

Each copy's whole gradient buffers are summed over the bd pair (``executor.pair_sums``, issued
during the schedule at the points the iteration plan gives, ``grad_reduction``; by finalize itself
where no schedule ran them), then each copy reduces over its data-parallel replicas as after
Megatron's 1F1B. No DDP wrapper, no flag: every answer is :class:`.way.CopySumWay`'s.
"""
from __future__ import annotations

from .way import CopySumWay


class BdFirst(CopySumWay):
    pass


WAY = BdFirst()

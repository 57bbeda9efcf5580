"""The default way of summing a DualPipe stage's two copies: the bd sum.

Each copy's whole gradient buffers are summed over the bd pair (``executor.pair_sums``, issued
during the schedule at the points the iteration plan gives, ``grad_reduction``), then each copy
reduces over its data-parallel replicas as after Megatron's 1F1B. No DDP wrapper, no flag.
"""
from __future__ import annotations

from ..costs.comm_cost import BD_FIRST
from .copy_sum import ALWAYS, CopySum

WAY = CopySum(BD_FIRST, flag=None, marker=None, wrap_ddp=None, sums_in_schedule=True, sums_in_finalize=ALWAYS,
              stage_ordered_finalize=False)

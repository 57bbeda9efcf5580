"""dp-first (``--dualpipe-dp-first``, docs/design-shared-shard-group.md section 7): each copy of a stage
reduce-scatters over its replicas first, then the bd pair sums only the rank's ``1/dp`` shard of every
bucket: the same sum over disjoint rank sets, and the same shard on both copies (the partners share
data-parallel coordinates). Megatron's finalize calls ``finish_grad_sync`` chunk by chunk in stage order
(``CopySum.finalize_order``); the middle rank of an odd pipeline sums its two copies first, in finalize.
"""
from __future__ import annotations

from typing import Sequence

from ...schedule.copy_sum import DP_FIRST
from .. import bd_pairs
from .way import CopySumWay

__all__ = ["DP_FIRST_ATTR", "WAY", "summing_shards_over_pairs"]

#: Set on a DDP chunk whose copies are summed after its reduce-scatter, on its shards.
DP_FIRST_ATTR = "dualpipe_dp_first"


def _buckets(ddp) -> list:
    """(bucket group, bucket) of every bucket, dense then expert-parallel."""
    groups = list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)
    return [(group, bucket) for group in groups for bucket in group.buckets]


def summing_shards_over_pairs(ddp_class):
    """``ddp_class`` (megatron-core's DDP or a subclass) whose ``finish_grad_sync`` ends with the bd
    pair's sum of this rank's shards; of the whole buckets after ``force_all_reduce`` (Megatron-LM's
    ``--save-wgrads-interval`` saves every gradient whole, as 1F1B's all-reduce leaves it)."""

    class DpFirstDDP(ddp_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            setattr(self, DP_FIRST_ATTR, True)
            self._dp_first_checked = False

        def finish_grad_sync(self, *args, **kwargs):
            super().finish_grad_sync(*args, **kwargs)
            # --save-wgrads-interval: an all-reduce over the replicas, and the pair sums it whole
            forced = bool(kwargs.get("force_all_reduce", args[0] if args else False))
            pos = bd_pairs.position()
            if pos.is_middle:  # both copies here, summed before the reduce-scatter
                return
            from ...executor import pair_sums
            from ..model import chunk_info

            stage = (chunk_info(self) or {}).get("stage", "?")
            buckets = [(g.intra_distributed_optimizer_instance_size, g.intra_distributed_optimizer_instance_rank,
                        b.grad_data) for g, b in _buckets(self)]
            if not self._dp_first_checked:  # the shards are summed element by element
                bd_pairs.check_same_structure(
                    [(str(grad.dtype), grad.numel(), size, rank) for size, rank, grad in buckets],
                    f"--dualpipe-dp-first: the gradient shards of stage {stage} (both copies need the same buckets "
                    f"and the same data-parallel rank)", pos)
                self._dp_first_checked = True
            from megatron.core.distributed.param_and_grad_buffer import shard_buffer

            # the whole buckets as an all-reduce over the replicas left them, else this rank's shard of each (the
            # views megatron-core's start_grad_sync reduce-scatters into)
            summed = [grad if forced else shard_buffer(grad, size)[rank] for size, rank, grad in buckets]
            pair_sums.sum_now(summed, pos.group, in_place=True, timeout_s=bd_pairs.BD_SUM_TIMEOUT_S,
                              what=f"global rank {pos.me}: the bd sum of stage {stage}'s gradient shards with "
                                   f"global rank {pos.partner} (--dualpipe-dp-first)")

    DpFirstDDP.__qualname__ = f"DpFirst{ddp_class.__name__}"
    return DpFirstDDP


class DpFirst(CopySumWay):
    """Summed on the shards after the reduce-scatter, in Megatron's finalize, in stage order."""

    way, marker = DP_FIRST, DP_FIRST_ATTR
    purpose = "reorders the sum of DualPipe's two copies of a stage"

    def wrap_ddp(self, ddp_class: type) -> type:
        return summing_shards_over_pairs(ddp_class)

    def sum_in_finalize(self, model: Sequence, bd_sum) -> None:
        """Only the middle rank of an odd pipeline, which holds both copies, sums them in finalize."""
        if bd_pairs.position().is_middle:
            bd_sum(model)


WAY = DpFirst()

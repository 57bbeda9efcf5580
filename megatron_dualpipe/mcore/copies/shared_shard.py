"""``--dualpipe-shared-shard-group`` (docs/design-shared-shard-group.md): each chunk's DDP
(:func:`over_shared_shard_groups`) and optimizer (:func:`per_stage_optimizer`, one per stage, chained in
ascending stage order: Megatron's chunk order would deadlock the partners on NCCL) built inside
:func:`..shard_groups.partial_groups_of`, so that they see the shard group; the mirror's optimizer
shards carry Megatron's own ``shared`` marks (:func:`megatron_marks`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import List

import torch

from ... import hooks
from ...schedule.copy_sum import SHARED_SHARD
from ..shard_groups import build_shard_groups, chunk_of, partial_groups_of, shard_groups_initialized
from .way import CopySumWay, chunks_in_stage_order

__all__ = ["WAY", "SHARED_ATTR", "over_shared_shard_groups", "per_stage_optimizer", "megatron_marks"]

#: Set on a DDP chunk built over its shared shard group: the gradient path reads it (no bd sum).
SHARED_ATTR = "dualpipe_shared_shards"


def over_shared_shard_groups(ddp_class):
    """``ddp_class`` (megatron-core's DDP or a subclass) built over the chunk's shard group."""

    class SharedShardDDP(ddp_class):
        def __init__(self, config, ddp_config, module, *args, **kwargs):
            kwargs.pop("pg_collection", None)
            kwargs.pop("full_param_layout", None)
            with partial_groups_of(chunk_of(module)):
                super().__init__(config, ddp_config, module, *args, **kwargs)
            setattr(self, SHARED_ATTR, True)

    SharedShardDDP.__qualname__ = f"SharedShard{ddp_class.__name__}"
    return SharedShardDDP


@contextlib.contextmanager
def megatron_marks(chunk: torch.nn.Module):
    """Within the block the mirror's parameters carry only Megatron's own ``shared`` marks."""
    from ..model import MEGATRON_SHARED_ATTR, unwrap_chunk

    inner = unwrap_chunk(chunk)
    own = getattr(inner, MEGATRON_SHARED_ATTR, None)  # set on the mirror only
    if own is None:
        yield
        return
    params = list(inner.named_parameters())
    try:
        for name, p in params:
            p.shared = name in own
        yield
    finally:
        for _, p in params:
            p.shared = True


def per_stage_optimizer(get_megatron_optimizer):
    """``get_megatron_optimizer`` for chunks wrapped by :func:`over_shared_shard_groups` (others
    go to Megatron's function unchanged)."""

    def build(config, model_chunks, *args, **kwargs):
        from megatron.core.optimizer import ChainedOptimizer

        if not WAY.marks(model_chunks):
            return get_megatron_optimizer(config, model_chunks, *args, **kwargs)
        if kwargs.get("pg_collection") is not None:
            raise NotImplementedError("--dualpipe-shared-shard-group: get_megatron_optimizer(pg_collection=...) "
                                      "would bypass the chunks' shard groups; call it without pg_collection")
        parts: List = []
        for c in chunks_in_stage_order(model_chunks):
            with partial_groups_of(c), megatron_marks(model_chunks[c]):
                built = get_megatron_optimizer(config, [model_chunks[c]], *args, **kwargs)
            parts += list(built.chained_optimizers) if isinstance(built, ChainedOptimizer) else [built]
        return ChainedOptimizer(parts)

    return build


class SharedShard(CopySumWay):
    """Summed by the reduce-scatter over both copies' ranks (each chunk's shard group), in Megatron's
    finalize, in stage order; one optimizer per stage over its shard group."""

    way, marker = SHARED_SHARD, SHARED_ATTR
    purpose = "shares the distributed optimizer between DualPipe's two copies of a stage"
    one_f_one_b_note = ("its optimizer share doubled: 1F1B shards a stage over the data-parallel ranks, the shared "
                        "shard group over twice as many)")

    def build_groups(self) -> None:
        if not shard_groups_initialized():
            build_shard_groups()

    def wrap_ddp(self, ddp_class: type) -> type:
        return over_shared_shard_groups(ddp_class)

    def building_optimizer(self):
        import megatron.training.training as mtraining

        return hooks.scoped(hooks.entry("scoped", "get_megatron_optimizer").made_by(per_stage_optimizer, on=mtraining))

    def sum_in_finalize(self, model, bd_sum) -> None:
        """None: the reduce-scatter over both copies' ranks sums them."""

    def checkpoint_view(self, home_copy_state, per_stage_state):
        return per_stage_state

    def one_f_one_b_bytes(self, home):
        """1F1B shards a stage's optimizer over ``dp`` ranks, this way over ``2 dp``: counted twice."""
        return dataclasses.replace(home, main_params=2 * home.main_params, optimizer_state=2 * home.optimizer_state)

    @contextlib.contextmanager
    def params_norm_chunks(self, model, reads_main_params: bool):
        """As the default way's, and with ``--bf16`` (``reads_main_params``: the norm reads the fp32
        main copies, which the distributed optimizer shards) the mirror's shards too: a stage's main
        copy is sharded over both copies' ranks, so the home ranks hold half of it. They count with
        Megatron's own ``shared`` marks (the tied output weight stays out, as in 1F1B)."""
        if not (reads_main_params and len(model) == 2):
            yield list(model[:1])
            return
        # the mirror as calc_params_l2_norm reads it (parameters() only): its parameters whose fp32 main copy is
        # a distributed-optimizer shard
        shards = types.SimpleNamespace(
            parameters=lambda: (p for p in model[1].parameters() if getattr(p, "main_param_sharded", False)))
        with megatron_marks(model[1]):
            yield [model[0], shards]


WAY = SharedShard()

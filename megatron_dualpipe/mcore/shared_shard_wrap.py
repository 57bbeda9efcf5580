"""DualPipe's chunks wrapped over their shared shard groups: DDP per chunk, one optimizer.

``--dualpipe-shared-shard-group`` (docs/design-shared-shard-group.md; the groups:
:mod:`.shard_groups`). Two megatron-core constructors are called per chunk inside
:func:`.shard_groups.partial_groups_of`, so that everything they derive from the group (bucket
padding, shard ranges, the optimizer's checkpoint groups) is the shard group's:

* :func:`over_shared_shard_groups` subclasses megatron-core's ``DistributedDataParallel``:
  the chunk's buffers reduce-scatter and all-gather over its ``2 dp`` ranks. The process
  groups come from ``parallel_state`` (a ``pg_collection`` from Megatron-LM would bypass the
  scope, and core_v0.19.0's precomputed ``full_param_layout`` is padded for ``dp`` shards: both
  are dropped, and DDP computes the layout for its own group);
* :func:`per_stage_optimizer` wraps ``get_megatron_optimizer``: one call per chunk, in ascending
  stage order, joined in one ``ChainedOptimizer``. Its sub-optimizers step, and so all-gather,
  in list order: stage order on both partners (Megatron's ``for chunk in model`` order would
  issue stage ``i`` first on rank ``i`` and stage ``pp-1-i`` first on its partner, over
  communicators that span the same ranks: a deadlock on NCCL, ``tests/schedule/test_issued_order.py``).

The mirror's parameters carry ``shared=True`` (DualPipe's mark: its gradients duplicate the
home's); under the shared group the mirror's optimizer shards are distinct parts of the stage
and count in the gradient norm and the zero count. :func:`megatron_marks` restores Megatron's own
marks while the mirror's optimizer copies them onto its shards.
"""
from __future__ import annotations

import contextlib
from typing import List

import torch

from ..costs.comm_cost import SHARED_SHARD
from .copy_sum import NEVER, CopySum
from .shard_groups import SHARED_ATTR, chunk_of, is_shared_layout, partial_groups_of, stage_order

__all__ = ["WAY", "over_shared_shard_groups", "per_stage_optimizer", "megatron_marks", "params_norm_chunks"]


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
    from .model import MEGATRON_SHARED_ATTR, unwrap_chunk

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


class _MainParamShards:
    """The mirror as Megatron-LM's ``calc_params_l2_norm`` reads it (``parameters()`` only): its
    parameters whose fp32 main copy is a distributed-optimizer shard (``main_param_sharded``)."""

    def __init__(self, chunk: torch.nn.Module):
        self.chunk = chunk

    def parameters(self):
        return (p for p in self.chunk.parameters() if getattr(p, "main_param_sharded", False))


@contextlib.contextmanager
def params_norm_chunks(model, reads_main_params: bool):
    """What Megatron-LM's ``calc_params_l2_norm`` is given for DualPipe's two chunks, so that its
    sum is 1F1B's: every parameter of every stage once.

    It reads each parameter whole (``param.data``: fp32, fp16, ``force_create_fp32_copy``), or,
    with ``--bf16`` (``reads_main_params``), the fp32 main copy, which the distributed optimizer
    shards; the shards' squares are summed over the ordinary data-parallel group. A whole
    parameter is counted at home (``model[0]``; the mirror's copy is the same tensor). Under the
    shared shard group a stage's main copy is sharded over both copies' ranks, and the home
    ranks hold only half of it: the mirror's shards count as well, with Megatron's own ``shared``
    marks (the tied output weight stays out, as in 1F1B)."""
    if not (reads_main_params and len(model) == 2 and is_shared_layout(model)):
        yield list(model[:1])
        return
    with megatron_marks(model[1]):
        yield [model[0], _MainParamShards(model[1])]


def per_stage_optimizer(get_megatron_optimizer):
    """``get_megatron_optimizer`` for chunks wrapped by :func:`over_shared_shard_groups` (others
    go to Megatron's function unchanged)."""

    def build(config, model_chunks, *args, **kwargs):
        from megatron.core.optimizer import ChainedOptimizer

        if not is_shared_layout(model_chunks):
            return get_megatron_optimizer(config, model_chunks, *args, **kwargs)
        if kwargs.get("pg_collection") is not None:
            raise NotImplementedError("--dualpipe-shared-shard-group: get_megatron_optimizer(pg_collection=...) "
                                      "would bypass the chunks' shard groups; call it without pg_collection")
        parts: List = []
        for c in stage_order(model_chunks):
            with partial_groups_of(c), megatron_marks(model_chunks[c]):
                built = get_megatron_optimizer(config, [model_chunks[c]], *args, **kwargs)
            parts += list(built.chained_optimizers) if isinstance(built, ChainedOptimizer) else [built]
        return ChainedOptimizer(parts)

    return build


#: Summed by the reduce-scatter over both copies' ranks (each chunk's shard group), in Megatron's
#: finalize, in stage order; one optimizer per stage over its shard group.
WAY = CopySum(SHARED_SHARD, flag="dualpipe_shared_shard_group", marker=SHARED_ATTR, wrap_ddp=over_shared_shard_groups,
              sums_in_schedule=False, sums_in_finalize=NEVER, stage_ordered_finalize=True, builds_shard_groups=True,
              optimizer=per_stage_optimizer, shards_over_both_copies=True)

"""Both chunks of a DualPipe / DualPipeV rank, built through Bridge's model provider.

Bridge's ``get_model`` calls ``_create_model(provider, model_type, pg_collection)`` for the raw chunks
and then does everything else itself (pre-wrap hooks, device placement, ``Float16Module``, DDP,
parameter broadcast). :func:`wrap_create_model` replaces that one step: the package's
``mcore.model.build_two_direction_model`` builds stage i and its mirror pp-1-i (DualPipeV: stages i
and 2pp-1-i) with the provider's own ``provide()``, each with its ``pg_collection`` (the mirror's on
the reversed pipeline group), so megatron-core numbers the layers and places the embedding, the
output layer and the loss as for that stage. Bridge's ``get_batch`` reads a chunk's place in the
pipeline from that same ``pg_collection``: tokens and labels by direction come with it.
"""
from __future__ import annotations

import functools

from .. import hooks
from .patches import PROVIDER_GROUPS
from ..schedule import registry

def wrap_create_model(orig):
    """Bridge's ``_create_model``, building both chunks under the active two-chunk schedule."""

    @functools.wraps(orig)
    def _create_model(model_provider, model_type, pg_collection):
        from . import switch

        schedule = switch.active_schedule()
        if schedule is None or registry.get(schedule).chunks_per_rank != 2:
            return orig(model_provider, model_type, pg_collection=pg_collection)
        return build_chunks(model_provider, model_type, pg_collection, schedule)

    return _create_model


def build_chunks(provider, model_type, pg_collection, schedule: str) -> list:
    """``[model_dir0, model_dir1]`` for this rank, with megatron-core's tensor-parallel defaults."""
    from megatron.core import tensor_parallel

    from ..mcore import groups
    from ..mcore.model import build_two_direction_model
    from ..megatron_lm.training_hooks import two_chunk_model_built

    from . import switch

    if not groups.bd_groups_initialized():
        groups.build_bd_groups()
    switch.with_v_stages(provider)
    layout = registry.get(schedule).layout_kind

    def one_chunk(pre_process, post_process, pg_collection, vp_stage):
        with hooks.scoped(PROVIDER_GROUPS.to(pg_collection, on=provider)):
            chunk = provider.provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        chunk.model_type = model_type
        if provider.use_cpu_initialization:  # the mirror broadcast needs the chunks on the communication device
            import torch

            chunk.cuda(torch.cuda.current_device())
        return chunk

    model = build_two_direction_model(one_chunk, layout_kind=layout, pg_collection=pg_collection)
    for chunk in model:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    return two_chunk_model_built(model, schedule)


def unbucketed_ddp(orig):
    """DualPipe: Bridge's ``_ddp_wrap`` buckets chunk 0 only; the two copies of a stage (chunk 0 at home,
    chunk 1 on the partner) are summed in place, buffer by buffer, and need one layout."""
    from ..megatron_lm.training_hooks import unbucketed_ddp_class

    return unbucketed_ddp_class(orig)


"""Bridge's ``save_checkpoint`` / ``load_checkpoint`` under DualPipe and DualPipeV, through the same
torch_dist strategies as Megatron-LM's loop (``megatron_lm.checkpoint``), so that the files hold
1F1B's keys and Bridge's own 1F1B resumes them (and the other way round).

Bridge's save builds the sharded state dict of every chunk with megatron-core's
``sharded_state_dict`` (global keys: the mirror's entries are its stage's, marked non-main replicas
when the chunks are built); what the strategies add is the same here as there: the mirror's entries
left out of the written dict (``torch_dist_mirror.drop_mirror_entries``, on Bridge's
``generate_state_dict``), the distributed optimizer's buffer-keyed state restricted to model[0]'s
buffers, and after a load the mirrors synced from their home copies (``mirrors.sync_mirrors``).
DualPipeV saves and loads as Megatron does (global keys), the copy of the embedding on rank 0's
second chunk written once (marked when built).

Under both, the distributed optimizer's fully reshardable state is written at each parameter's own
place (``megatron_lm.checkpoint.optimizers.exact_offsets``, as in Megatron-LM's loop): megatron-core
shifts a parameter that follows a padded bucket, which DualPipeV's first V-stage has where 1F1B's first
stage may not.
"""
from __future__ import annotations

import contextlib
import functools

from .. import hooks
from ..megatron_lm.checkpoint.optimizers import exact_offsets
from ..schedule import registry
from .patches import GENERATE_STATE_DICT


def _active():
    from . import switch

    return switch.active_schedule()


def _mirrored(schedule) -> bool:
    """Whether the active schedule keeps a mirrored copy of every stage (``ScheduleSpec.mirrored``)."""
    return schedule is not None and registry.get(schedule).mirrored


def wrap_save_checkpoint(orig):
    """Bridge's ``save_checkpoint(state, model, optimizer, ...)`` writing 1F1B's keys."""

    @functools.wraps(orig)
    def save_checkpoint(state, model, optimizer, *args, **kwargs):
        from ..megatron_lm.checkpoint import torch_dist_mirror
        from ..megatron_lm.checkpoint.megatron_io import state_dict_editor

        schedule = _active()
        if schedule is None or registry.get(schedule).chunks_per_rank != 2:
            return orig(state, model, optimizer, *args, **kwargs)
        with hooks.scoped(GENERATE_STATE_DICT.made_by(state_dict_editor(torch_dist_mirror.drop_mirror_entries))), \
                _home_buffers(schedule, model, optimizer), exact_offsets(optimizer):
            return orig(state, model, optimizer, *args, **kwargs)

    return save_checkpoint


def wrap_load_checkpoint(orig):
    """Bridge's ``load_checkpoint(state, model, optimizer, ...)``: under DualPipe every replica reads
    its stage's shards (model[0]'s optimizer buffers), then the mirrors are synced from home."""

    @functools.wraps(orig)
    def load_checkpoint(state, model, optimizer, *args, **kwargs):
        from ..megatron_lm.checkpoint.mirrors import sync_mirrors

        schedule = _active()
        with _home_buffers(schedule, model, optimizer), exact_offsets(optimizer if schedule else None):
            result = orig(state, model, optimizer, *args, **kwargs)
        if _mirrored(schedule):
            sync_mirrors(model, optimizer)
        return result

    return load_checkpoint


def _home_buffers(schedule, model, optimizer):
    """DualPipe: the distributed optimizer's dp_reshardable state is model[0]'s buffers only."""
    from ..megatron_lm.checkpoint import torch_dist_mirror

    if not _mirrored(schedule):
        return contextlib.nullcontext()
    return torch_dist_mirror.model0_distributed_optimizers(model, optimizer)

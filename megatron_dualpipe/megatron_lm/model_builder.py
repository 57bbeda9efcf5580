"""DualPipe / DualPipeV chunks through Megatron-LM core_v0.19.0's model builder, which calls
``dist_utils.unimodal_build_distributed_models`` instead of ``training.get_model``: the pieces it calls
are swapped for the call; everything else is Megatron's code."""
from __future__ import annotations

import functools
import importlib

from .. import hooks
from ..hooks.manifest import MODEL_BUILDER_SCOPED
from ..hooks.manifest import V_CONFIG as _V_CONFIG
from ..mcore import copies
from ..mcore.model import build_two_direction_model, dualpipev_config
from ..schedule import registry
from ..schedule.layout import V_SHAPE
from .arguments import schedule_of
from .training_hooks import build_pair_groups, count_printer, two_chunk_model_built

_DIST_UTILS = "megatron.training.models.dist_utils"


def wrap_unimodal_build_distributed_models(orig):
    @functools.wraps(orig)
    def unimodal_build_distributed_models(build_model_func, transformer_config, pg_collection, *args, **kwargs):
        from megatron.training import get_args

        args_ = get_args()
        schedule = schedule_of(args_)
        spec = registry.get(schedule)
        if spec.chunks_per_rank != 2:
            return orig(build_model_func, transformer_config, pg_collection, *args, **kwargs)
        if getattr(transformer_config, "init_model_with_meta_device", False):
            raise NotImplementedError(
                f"--pipeline-schedule {schedule}: --init-model-with-meta-device is not supported (the mirrored "
                "copies are broadcast right after construction); remove it")
        build_pair_groups(args_)
        dist_utils = importlib.import_module(_DIST_UTILS)
        built = {}
        swaps = [_SCOPED["build_virtual_pipeline_stages"].to(
                     _two_chunk_stages(build_model_func, spec, transformer_config, built, dist_utils), on=dist_utils),
                 _SCOPED["print"].to(count_printer(built), on=dist_utils)]
        if spec.layout_kind == V_SHAPE:
            swaps.append(_SCOPED["_wrap_with_mp_wrapper"].made_by(_wrapped_with_chunk_config, on=dist_utils))
        if spec.mirrored:
            swaps += [_SCOPED["_ddp_wrap"].made_by(_unbucketed, on=dist_utils),
                      _SCOPED["DistributedDataParallel"].made_by(copies.chosen(args_).wrap_ddp, on=dist_utils)]
        with hooks.scoped(*swaps):
            model = orig(build_model_func, transformer_config, pg_collection, *args, **kwargs)
        return two_chunk_model_built(list(model), schedule)

    return unimodal_build_distributed_models


def _two_chunk_stages(build_model_func, spec, transformer_config, built, dist_utils):
    """``build_virtual_pipeline_stages`` for a two-chunk schedule: [model_dir0, model_dir1]."""

    def stages(build_func, pg_collection, vp_size, model_type=None):
        def one_chunk(pg_collection, pre_process, post_process, vp_stage):
            chunk = build_func(pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
            if model_type is not None:
                chunk.model_type = model_type
            if getattr(transformer_config, "use_cpu_initialization", False):
                # Megatron places the chunks later; the mirror broadcast needs them on the device now.
                chunk.cuda(dist_utils.torch.cuda.current_device())
            return chunk

        swaps = []
        if spec.layout_kind == V_SHAPE:
            model_config = build_func.__self__._model_config  # the GPTModelBuilder's GPTModelConfig
            swaps.append(_V_CONFIG.to(dualpipev_config(model_config.transformer), on=model_config))
        with hooks.scoped(*swaps):
            chunks = build_two_direction_model(one_chunk, layout_kind=spec.layout_kind, pg_collection=pg_collection)
        built["chunks"] = list(chunks)
        return chunks

    return stages


def _wrapped_with_chunk_config(wrap_with_mp_wrapper):
    """``_wrap_with_mp_wrapper`` with each chunk's own config: with the builder's (no V-stages)
    ``Float16Module`` would take DualPipeV's V-stage ``pp-1`` for the model's end (an fp32 upcast)."""
    from megatron.core.utils import get_model_config

    @functools.wraps(wrap_with_mp_wrapper)
    def wrapped(model_list, transformer_config, *a, **kw):
        return [wrap_with_mp_wrapper([chunk], get_model_config(chunk), *a, **kw)[0] for chunk in model_list]

    return wrapped


def _unbucketed(ddp_wrap):
    """``_ddp_wrap`` with every chunk unbucketed: its 4th argument
    (``overlap_param_gather_with_optimizer_step``) only disables bucketing there."""

    @functools.wraps(ddp_wrap)
    def wrapped(model, data_parallel_random_init, ddp_config, overlap_param_gather_with_optimizer_step, *a, **kw):
        return ddp_wrap(model, data_parallel_random_init, ddp_config, True, *a, **kw)

    return wrapped


_SCOPED = {p.attribute: p for p in MODEL_BUILDER_SCOPED}

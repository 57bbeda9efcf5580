"""DualPipe / DualPipeV chunks through Megatron-LM core_v0.19.0's model builder.

From core_v0.19.0 on, ``pretrain_gpt.py`` no longer builds the model with
``training.get_model(model_provider)`` (what :func:`.training_hooks.wrap_get_model` hooks at
core_v0.16.1): it hands ``pretrain`` a config container, and ``GPTModelBuilder.
build_distributed_models`` calls ``models.dist_utils.unimodal_build_distributed_models(
self.build_model, ...)``, which builds the stages (``build_virtual_pipeline_stages``), counts the
parameters, places, wraps (``Float16Module``) and DDP-wraps them (``_ddp_wrap``). The hook here
(manifest entry ``megatron.training.models.gpt.unimodal_build_distributed_models``, megatron-core
0.19 and later) does for that path what ``wrap_get_model`` does for the other, with the same
pieces:

1. ``build_virtual_pipeline_stages`` is swapped, for the call, for one that builds both chunks
   with ``mcore.model.build_two_direction_model`` from the builder's own ``build_model`` (for
   DualPipeV the builder's ``TransformerConfig`` is the ``dualpipev_config`` copy meanwhile);
2. DualPipe: ``_ddp_wrap`` buckets no chunk (as ``_unbucketed_ddp`` does at 0.16.1: the two
   copies of a stage are summed buffer by buffer and need one layout); with
   its ``DistributedDataParallel`` is the class the way the copies are summed makes (``mcore.copies``:
   with ``--dualpipe-shared-shard-group`` the subclass that builds each chunk over its shard group);
3. the parameter-count line says the logical and physical counts;
4. after the build: the mirror is marked for torch_dist, and each rank says what it holds.

Everything else (Float16Module, DDP per chunk, ``--data-parallel-random-init``) is Megatron's
code, unchanged. With ``--pipeline-schedule 1f1b`` / ``executor-1f1b`` / ``zb-h1`` the call goes
straight to Megatron's function.
"""
from __future__ import annotations

import functools

from .. import hooks
from ..schedule import registry

_DIST_UTILS = "megatron.training.models.dist_utils"


def wrap_unimodal_build_distributed_models(orig):
    @functools.wraps(orig)
    def unimodal_build_distributed_models(build_model_func, transformer_config, pg_collection, *args, **kwargs):
        from megatron.training import get_args

        from .arguments import schedule_of

        args_ = get_args()
        schedule = schedule_of(args_)
        spec = registry.get(schedule)
        if spec.chunks_per_rank != 2:
            return orig(build_model_func, transformer_config, pg_collection, *args, **kwargs)
        if getattr(transformer_config, "init_model_with_meta_device", False):
            raise NotImplementedError(
                f"--pipeline-schedule {schedule}: --init-model-with-meta-device is not supported (the mirrored "
                "copies are broadcast right after construction); remove it")
        import importlib

        from ..mcore.model import V_SHAPE
        from .training_hooks import build_pair_groups, copy_sum

        build_pair_groups(args_)
        dist_utils = importlib.import_module(_DIST_UTILS)
        built = {}
        swaps = [_SCOPED["build_virtual_pipeline_stages"].to(
                     _two_chunk_stages(build_model_func, spec, transformer_config, built), on=dist_utils),
                 _SCOPED["print"].to(_count_printer(built), on=dist_utils)]
        if spec.layout_kind == V_SHAPE:
            swaps.append(_SCOPED["_wrap_with_mp_wrapper"].made_by(_wrapped_with_chunk_config, on=dist_utils))
        if spec.mirrored:
            swaps += [_SCOPED["_ddp_wrap"].made_by(_unbucketed, on=dist_utils),
                      _SCOPED["DistributedDataParallel"].made_by(copy_sum(args_).wrap_ddp, on=dist_utils)]
        with hooks.scoped(*swaps):
            model = orig(build_model_func, transformer_config, pg_collection, *args, **kwargs)
        return _after_build(list(model), schedule)

    return unimodal_build_distributed_models


def _two_chunk_stages(build_model_func, spec, transformer_config, built):
    """``build_virtual_pipeline_stages`` for a two-chunk schedule: [model_dir0, model_dir1]."""
    from ..mcore.model import V_SHAPE, build_two_direction_model, dualpipev_config

    def stages(build_func, pg_collection, vp_size, model_type=None):
        import importlib

        dist_utils = importlib.import_module(_DIST_UTILS)

        def one_chunk(pg_collection, pre_process, post_process, vp_stage):
            chunk = build_func(pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
            if model_type is not None:
                chunk.model_type = model_type
            if getattr(transformer_config, "use_cpu_initialization", False):
                # Megatron places the chunks after this returns; the mirror broadcast inside
                # build_two_direction_model must see them on the communication device already.
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
    """``_wrap_with_mp_wrapper`` that hands each chunk's mixed-precision wrapper the chunk's own
    config. DualPipeV's chunks are built with ``dualpipev_config`` (two V-stages); the builder's
    config has none, and ``Float16Module`` decides "first / last stage" from that config's
    virtual size with the physical pipeline rank: V-stage ``pp-1`` (``model[0]`` on the last rank)
    would upcast its output to fp32 as if it ended the model, and V-stage ``pp`` would fail
    ``is_vp_first_stage``'s check of ``vp_stage=1``."""
    from megatron.core.utils import get_model_config

    @functools.wraps(wrap_with_mp_wrapper)
    def wrapped(model_list, transformer_config, *a, **kw):
        return [wrap_with_mp_wrapper([chunk], get_model_config(chunk), *a, **kw)[0] for chunk in model_list]

    return wrapped


def _unbucketed(ddp_wrap):
    """``_ddp_wrap`` with every chunk unbucketed: its ``overlap_param_gather_with_optimizer_step``
    argument (4th) is what disables bucketing for chunk 0 (and for the parameter layout of the
    distributed optimizer alike); the flag has no other use there."""

    @functools.wraps(ddp_wrap)
    def wrapped(model, data_parallel_random_init, ddp_config, overlap_param_gather_with_optimizer_step, *a, **kw):
        return ddp_wrap(model, data_parallel_random_init, ddp_config, True, *a, **kw)

    return wrapped


def _count_printer(built):
    import builtins

    from .training_hooks import parameter_count_line

    def print_(*args, **kwargs):
        if len(args) == 1 and isinstance(args[0], str) and "chunks" in built:
            args = (parameter_count_line(args[0], built["chunks"]),)
        return builtins.print(*args, **kwargs)

    return print_


def _after_build(model, schedule):
    from .training_hooks import two_chunk_model_built

    return two_chunk_model_built(model, schedule)


def _entries():
    from ..hooks.manifest import MODEL_BUILDER_SCOPED, V_CONFIG

    return {p.attribute: p for p in MODEL_BUILDER_SCOPED}, V_CONFIG


_SCOPED, _V_CONFIG = _entries()

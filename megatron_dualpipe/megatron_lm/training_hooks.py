"""Wire ``--pipeline-schedule`` (the executor's schedules) into ``megatron.training``.

:func:`install` replaces two module globals of ``megatron.training.training`` (both are looked
up at call time by ``setup_model_and_optimizer``, ``train`` and ``evaluate``) and, through
:mod:`.checkpoint`, its by-name imports of ``save_checkpoint`` / ``load_checkpoint``.
With ``--pipeline-schedule 1f1b`` (the default) every wrapper calls the original with the same
arguments and returns its result: Megatron behaves exactly as without the plugin.

``get_model`` (DualPipe / DualPipeV)
    1. ``groups.build_bd_groups()`` once (collective; the first ``get_model`` call is right
       after ``initialize_megatron`` on every rank, in the same order), and with
       ``--dualpipe-shared-shard-group`` the shard groups (``mcore.shard_groups``), whose DDP
       subclass then wraps each chunk (``mcore.copies.shared_shard``);
    2. Megatron's own ``get_model`` runs with a provider that returns *both* chunks, built by
       ``mcore.model.build_two_direction_model`` (stage ``i`` and its mirror ``pp-1-i`` for
       DualPipe, stages ``i`` and ``2pp-1-i`` for DualPipeV), with one shared
       ``TransformerConfig``. The provider returns them as a list, which stock ``get_model``
       accepts (``if not isinstance(model, list)``), so everything after the build is
       Megatron's code, unchanged: tensor-parallel default attributes, the parameter count,
       device placement, ``Float16Module`` for fp16/bf16, the ``DistributedDataParallelConfig``
       from ``args``, DDP per chunk (bucketing off for chunk 1, as with a virtual pipeline),
       and ``broadcast_params`` with ``--data-parallel-random-init``.
       ``build_two_direction_model`` broadcasts the mirrors and marks ``model[1]`` ``shared``
       before it returns, i.e. long before ``get_megatron_optimizer`` runs.
``get_forward_backward_func``
    ``1f1b`` -> Megatron's own (unchanged); otherwise
    ``mcore.forward_backward.get_forward_backward_func(schedule, zero_bubble=...,
    p2p_timeout=...)``, whose function finalizes gradients through
    ``config.finalize_model_grads_func`` (Megatron's ``finalize_model_grads``, set by
    ``train()``) -- for two chunks via ``finalize.finalize_dualpipe_grads`` after the bd
    all-reduce -- and returns the loss dicts of both directions on the last pipeline rank,
    where ``train_step`` / ``evaluate`` read them.
``calc_params_l2_norm`` (``--log-params-norm``, DualPipe)
    gets ``model[:1]``: ``model[1]`` holds only mirrored copies, each counted once already
    through its home rank's ``model[0]``. (Megatron's function skips parameters marked
    ``shared`` but asserts that expert parameters are not, so the whole two-chunk model trips
    that assert with MoE.) Under the shared shard group with ``--bf16`` it reads the fp32 main
    copies, half of whose shards are the mirror's: those are added
    (``mcore.copies.shared_shard``, the way's ``params_norm_chunks``).
The parameter count
    Stock ``get_model`` prints `` > number of parameters on (tensor, pipeline) model parallel
    rank (t, p): N`` summed over the chunks it was given. Under DualPipe the line keeps its
    prefix, and says the logical count (this rank's home stage, what 1F1B prints; summed over
    the pipeline every stage is counted once) and, separately, the physical count with the
    mirrored copy; under DualPipeV it names the two stages (nothing is duplicated).
``setup_model_and_optimizer`` (DualPipe / DualPipeV)
    with ``--dualpipe-shared-shard-group``, Megatron's ``get_megatron_optimizer`` is called per
    chunk, in ascending stage order, over its shard group (``mcore.copies.shared_shard.per_stage_optimizer``);
    after Megatron's own returns (model built, optimizer built, checkpoint loaded), every rank
    counts the bytes of its parameters, gradients and optimizer state per chunk
    (``mcore.state_bytes``; one all-gather) and rank 0 prints one table: per pipeline rank this
    schedule's bytes and, under DualPipe, what 1F1B holds in the same configuration (the rank's
    own stage, ``model[0]``).
``megatron.training.arguments.core_transformer_config_from_args`` (``--overlap-moe-expert-parallel-comm``)
    megatron-core's ``TransformerConfig`` refuses the flag with a pipeline but no virtual
    pipeline, and ``pretrain_gpt.py`` builds a config from ``args`` on every ``get_batch``. With
    an executor schedule the wrapper builds the config with the flag (and
    ``--delay-wgrad-compute``) off and turns them on afterwards through
    ``mcore.overlap.enable_combined_step``: the fused units come from DualPipe, not from a
    virtual pipeline. ``--delay-wgrad-compute`` alone (refused by megatron-core without the
    combined step, which is the only caller of ``backward_dw`` there) is let through the same
    way: the executor's W actions call ``backward_dw``. ``args`` keeps the flag (``pretrain_gpt.forward_step`` asserts it before
    returning a schedule plan). ``pretrain_gpt.py`` and ``gpt_builders.py`` import the function
    by name, after ``install()`` (launcher or patch hook), so they get the wrapper. core_v0.19.0
    defines it in ``megatron.training.argument_utils`` (``arguments`` re-exports it), whose
    ``gpt_config_from_args`` builds ``pretrain_gpt.py``'s model config: wrapped there as well.
Data
    Nothing to hook: the non-virtual-pipeline branch of ``pretrain()`` builds one iterator per
    rank, and the executor splits it into the two directions itself (``mcore.data``).
"""

import functools

from .. import hooks
from ..schedule import registry
from .arguments import schedule_of

_PART = "megatron-lm training"  # hooks/manifest.py lists what install() patches


def forward_backward_options(args) -> dict:
    """Keyword options of the dispatcher taken from the parsed arguments."""
    opts = {"zero_bubble": bool(getattr(args, "dualpipe_zero_bubble", True)),
            "advise": bool(getattr(args, "dualpipe_advise", False)),
            "drift_check_every": int(getattr(args, "dualpipe_drift_check_interval", 0) or 0)}
    if getattr(args, "dualpipe_advise_warmup", None) is not None:
        opts["advise_warmup"] = int(args.dualpipe_advise_warmup)
    timeout = getattr(args, "dualpipe_p2p_timeout", None)
    if timeout is None:
        minutes = getattr(args, "distributed_timeout_minutes", None)
        timeout = float(minutes) * 60.0 if minutes else None
    if timeout is not None:
        opts["p2p_timeout"] = float(timeout)
    return opts


class _Chunks(list):
    """The two chunks, as the one "model" stock ``get_model`` receives from the provider (a list
    subclass so that ``model.model_type = ...`` works; stock code then treats it as its list)."""


def _two_chunk_provider(model_provider_func, schedule, model_type, config, built=None):
    """A provider with stock ``get_model``'s calling convention that builds both chunks (and
    puts them in the dict ``built`` under "chunks", for the parameter-count line)."""
    from megatron.core.utils import get_model_config
    from megatron.training import get_args

    from ..mcore.model import V_SHAPE, build_two_direction_model, dualpipev_config

    args = get_args()
    layout = registry.get(schedule).layout_kind

    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        shared = {"config": config}
        if layout == V_SHAPE:
            if shared["config"] is None:
                shared["config"] = _default_config(args)
            shared["config"] = dualpipev_config(shared["config"])

        def one_chunk(**kw):
            chunk = model_provider_func(config=shared["config"], **kw)
            chunk.model_type = model_type
            if shared["config"] is None:  # the second chunk gets the first one's config object
                shared["config"] = get_model_config(chunk)
            if getattr(args, "use_cpu_initialization", False):
                # Stock get_model places the chunks next (model_module.cuda(current_device())),
                # after our provider returns; the mirror broadcast inside
                # build_two_direction_model must already see them on the communication device.
                # Same call, through the same module-global ``torch`` as stock get_model.
                import megatron.training.training as mtraining

                chunk.cuda(mtraining.torch.cuda.current_device())
            return chunk

        chunks = _Chunks(build_two_direction_model(one_chunk, layout_kind=layout, pg_collection=pg_collection))
        if built is not None:
            built["chunks"] = list(chunks)
        return chunks

    return provider


#: Megatron's parameter-count line starts so: "(tensor, pipeline) model parallel rank" at
#: core_v0.16.1, "(tensor, gtp_remat, pipeline) model parallel rank" at core_v0.19.0.
PARAMETER_COUNT_PREFIX = " > number of parameters on (tensor, "


def parameter_count_line(line: str, chunks) -> str:
    """Megatron's parameter-count line for a two-chunk rank: logical and physical counts."""
    from ..mcore.model import chunk_info

    if not line.startswith(PARAMETER_COUNT_PREFIX) or len(chunks) != 2:
        return line
    head = line.rsplit(":", 1)[0]
    counts = [sum(p.nelement() for p in c.parameters()) for c in chunks]
    infos = [chunk_info(c) or {} for c in chunks]
    stages = [info.get("stage") for info in infos]
    if infos[0].get("layout") == "bidirectional":
        return (f"{head}: {counts[0]} (logical: stage {stages[0]}; physical on this rank, with the mirrored "
                f"copy of stage {stages[1]}: {counts[0] + counts[1]})")
    return f"{head}: {counts[0] + counts[1]} (stages {stages[0]} and {stages[1]}: {counts[0]} + {counts[1]})"


def copy_sum(args):
    """How DualPipe's stage copies are summed, as the arguments choose (``mcore.copies``)."""
    from ..mcore.copies import chosen

    return chosen(args)


def build_pair_groups(args) -> None:
    """The bd groups, and the shard groups if the way the copies are summed needs them (collective;
    once, before the chunks are built)."""
    from ..mcore import groups

    if not groups.bd_groups_initialized():
        groups.build_bd_groups()
    copy_sum(args).build_groups()


def _unbucketed_ddp(module, wrap):
    """Within the block, ``module.DDP`` (what stock ``get_model`` wraps each chunk in) builds every
    chunk with ``disable_bucketing=True``. Stock DDP buckets only the first chunk on pipeline rank 0,
    so with --overlap-grad-reduce stage 0's home copy would be bucketed and its mirror (rank
    pp-1's model[1]) not; DualPipe sums the two copies in place, buffer by buffer, which needs the
    same layout on both. (A chunk's gradients are final all at once, after its last W, so buckets
    would not let its reduction start earlier.)"""

    def unbucketed(orig):
        return unbucketed_ddp_class(wrap(orig))

    return hooks.entry("scoped", "DDP").made_by(unbucketed, on=module)


def unbucketed_ddp_class(ddp_class):
    """``ddp_class`` that builds every chunk with ``disable_bucketing=True`` (see `_unbucketed_ddp`;
    also Megatron-Bridge's ``_ddp_wrap``, ``bridge/model.py``)."""

    class UnbucketedDDP(ddp_class):
        def __init__(self, *args, **kwargs):
            kwargs["disable_bucketing"] = True
            super().__init__(*args, **kwargs)

    return UnbucketedDDP


def _parameter_count_rewritten(module, built):
    """Within the block, ``print`` in ``module``'s globals rewrites Megatron's parameter-count
    line (`parameter_count_line`) and passes every other call to the builtin unchanged."""
    import builtins

    def print_(*args, **kwargs):
        if len(args) == 1 and isinstance(args[0], str) and "chunks" in built:
            args = (parameter_count_line(args[0], built["chunks"]),)
        return builtins.print(*args, **kwargs)

    return hooks.entry("scoped", "print").to(print_, on=module)


def _default_config(args):
    """The TransformerConfig Megatron-LM's GPT builder would make (DualPipeV needs it up front)."""
    if getattr(args, "yaml_cfg", None) is not None:
        from megatron.training.yaml_arguments import core_transformer_config_from_yaml

        return core_transformer_config_from_yaml(args, "language_model")
    from megatron.training.arguments import core_transformer_config_from_args

    return core_transformer_config_from_args(args)


def wrap_get_model(orig):
    @functools.wraps(orig)
    def get_model(model_provider_func, model_type=None, wrap_with_ddp=True, config=None, pg_collection=None):
        from megatron.core.enums import ModelType
        from megatron.training import get_args

        if model_type is None:
            model_type = ModelType.encoder_or_decoder
        args = get_args()
        schedule = schedule_of(args)
        if registry.get(schedule).chunks_per_rank != 2:
            return orig(model_provider_func, model_type, wrap_with_ddp, config=config, pg_collection=pg_collection)
        build_pair_groups(args)
        import megatron.training.training as mtraining

        built = {}
        provider = _two_chunk_provider(model_provider_func, schedule, model_type, config, built)
        swaps = [_parameter_count_rewritten(mtraining, built)]
        if registry.get(schedule).mirrored:
            swaps.append(_unbucketed_ddp(mtraining, copy_sum(args).wrap_ddp))
        with hooks.scoped(*swaps):
            model = orig(provider, model_type, wrap_with_ddp, config=config, pg_collection=pg_collection)
        return two_chunk_model_built(list(model), schedule)

    return get_model


def two_chunk_model_built(model, schedule: str):
    """The two chunks a model build returned, checked, the mirror marked for torch_dist, and one line
    per pipeline rank saying which stages it holds (get_model's path and 0.19's model builder)."""
    if len(model) != 2:
        raise RuntimeError(f"--pipeline-schedule {schedule}: expected 2 model chunks, got {len(model)}")
    from .checkpoint.torch_dist_mirror import mark_mirror_replicas, mark_v_tied_output_weight

    if registry.get(schedule).mirrored:
        mark_mirror_replicas(model[1])  # torch_dist: the mirror is a non-main replica
    else:
        mark_v_tied_output_weight(model)  # torch_dist: written once, as the embedding
    from megatron.core import parallel_state

    from ..mcore.model import describe_chunks

    if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
        print(f"[megatron-dualpipe] {schedule} pipeline rank {parallel_state.get_pipeline_model_parallel_rank()}: "
              f"{describe_chunks(model)}", flush=True)
    return model


def wrap_get_forward_backward_func(orig):
    @functools.wraps(orig)
    def get_forward_backward_func(*a, **kw):
        from megatron.training import get_args

        args = get_args()
        schedule = schedule_of(args)
        if registry.get(schedule).runs_on == registry.MEGATRON:
            return orig(*a, **kw)
        from ..mcore.forward_backward import get_forward_backward_func as dispatch

        return dispatch(schedule, **forward_backward_options(args))

    return get_forward_backward_func


def wrap_setup_model_and_optimizer(orig):
    @functools.wraps(orig)
    def setup_model_and_optimizer(*a, **kw):
        from megatron.training import get_args

        args = get_args()
        with copy_sum(args).building_optimizer():
            out = orig(*a, **kw)
        schedule = schedule_of(args)
        if registry.get(schedule).chunks_per_rank == 2:
            log_state_bytes(schedule, out[0], out[1])
        return out

    return setup_model_and_optimizer


def log_state_bytes(schedule: str, model, optimizer) -> None:
    """Every rank counts (collective over the world), rank 0 prints the table."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..mcore import copies, state_bytes

    rows, allocated = state_bytes.gather_table(model, optimizer, parallel_state.get_pipeline_model_parallel_rank())
    if dist.get_rank() == 0:
        print(state_bytes.format_table(schedule, rows, allocated,
                                       with_1f1b=registry.get(schedule).mirrored, way=copies.of(model)), flush=True)


def wrap_config_from_args(orig):
    @functools.wraps(orig)
    def core_transformer_config_from_args(args, *a, **kw):
        from ..mcore.overlap import COMBINED_STEP_FLAGS, enable_combined_step, enable_deferred_wgrads

        flags = {name: getattr(args, name, False) for name in COMBINED_STEP_FLAGS}
        if not any(flags.values()) or registry.get(schedule_of(args)).runs_on != registry.EXECUTOR:
            return orig(args, *a, **kw)
        try:
            for name in flags:
                setattr(args, name, False)
            config = orig(args, *a, **kw)
        finally:
            for name, value in flags.items():
                setattr(args, name, value)
        if flags["overlap_moe_expert_parallel_comm"]:
            return enable_combined_step(config, delay_wgrad_compute=flags["delay_wgrad_compute"])
        return enable_deferred_wgrads(config)  # TE defers; the executor's W actions run backward_dw()

    return core_transformer_config_from_args


def wrap_calc_params_l2_norm(orig):
    @functools.wraps(orig)
    def calc_params_l2_norm(model, force_create_fp32_copy=False, *a, **kw):
        from megatron.training import get_args

        args = get_args()
        if not registry.get(schedule_of(args)).mirrored or not isinstance(model, list) or len(model) != 2:
            return orig(model, force_create_fp32_copy, *a, **kw)
        from ..mcore.copies import of

        reads_main_params = bool(getattr(args, "bf16", False)) and not force_create_fp32_copy
        with of(model).params_norm_chunks(model, reads_main_params) as chunks:
            return orig(chunks, force_create_fp32_copy, *a, **kw)

    return calc_params_l2_norm


def install():
    """Patch ``megatron.training`` (the ``megatron-lm training`` part of the hooks manifest:
    these wrappers and the checkpoint ones; idempotent)."""
    hooks.install([_PART])

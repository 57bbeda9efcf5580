"""Wrappers of ``megatron.training`` globals its functions look up at call time (the manifest's
``megatron-lm training`` part says why each); under ``1f1b`` each calls the original unchanged."""

import builtins
import functools

from .. import hooks
from ..mcore import copies, groups
from ..mcore.model import build_two_direction_model, chunk_info, describe_chunks, dualpipev_config
from ..schedule import registry
from ..schedule.layout import V_SHAPE
from .arguments import schedule_of
from .checkpoint.torch_dist_mirror import mark_mirror_replicas, mark_v_tied_output_weight


def _megatron_args():
    """Megatron-LM's parsed arguments (``megatron.training`` imported late, at call time)."""
    from megatron.training import get_args

    return get_args()


def forward_backward_options(args) -> dict:
    """Keyword options of the dispatcher taken from the parsed arguments."""
    opts = {"zero_bubble": bool(getattr(args, "dualpipe_zero_bubble", True)),
            "advise": bool(getattr(args, "dualpipe_advise", False)),
            "drift_check_every": int(getattr(args, "dualpipe_drift_check_interval", 0) or 0)}
    if getattr(args, "dualpipe_advise_warmup", None) is not None:
        opts["advise_warmup"] = int(args.dualpipe_advise_warmup)
    timeout, minutes = getattr(args, "dualpipe_p2p_timeout", None), getattr(args, "distributed_timeout_minutes", None)
    if timeout is None and minutes:
        timeout = float(minutes) * 60.0
    if timeout is not None:
        opts["p2p_timeout"] = float(timeout)
    return opts


class _Chunks(list):
    """The two chunks as the one "model" stock ``get_model`` receives (a list that takes ``model_type``)."""


def _two_chunk_provider(model_provider_func, schedule, model_type, built):
    """A provider with stock ``get_model``'s calling convention that builds both chunks (into ``built``)."""
    import megatron.training.training as mtraining
    from megatron.core.utils import get_model_config

    args = _megatron_args()
    layout = registry.get(schedule).layout_kind

    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        shared = {"config": config}
        if layout == V_SHAPE:
            shared["config"] = dualpipev_config(config if config is not None else _default_config(args))

        def one_chunk(**kw):
            chunk = model_provider_func(config=shared["config"], **kw)
            chunk.model_type = model_type
            if shared["config"] is None:  # the second chunk gets the first one's config object
                shared["config"] = get_model_config(chunk)
            if getattr(args, "use_cpu_initialization", False):
                # stock get_model moves the chunks only after the provider; the mirror broadcast needs them there
                chunk.cuda(mtraining.torch.cuda.current_device())
            return chunk

        chunks = _Chunks(build_two_direction_model(one_chunk, layout_kind=layout, pg_collection=pg_collection))
        built["chunks"] = list(chunks)
        return chunks

    return provider


#: Megatron's parameter-count line starts so: "(tensor, pipeline) model parallel rank" at
#: core_v0.16.1, "(tensor, gtp_remat, pipeline) model parallel rank" at core_v0.19.0.
PARAMETER_COUNT_PREFIX = " > number of parameters on (tensor, "


def parameter_count_line(line: str, chunks) -> str:
    """Megatron's parameter-count line for a two-chunk rank: logical and physical counts."""
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


def build_pair_groups(args) -> None:
    """The bd groups, and the shard groups the way the copies are summed needs (collective, before the build)."""
    if not groups.bd_groups_initialized():
        groups.build_bd_groups()
    copies.chosen(args).build_groups()


def _unbucketed_ddp(module, wrap):
    """Within the block, ``module.DDP`` builds every chunk unbucketed: the in-place bd sum needs both
    copies of a stage laid out alike (stock ``get_model`` buckets only pipeline rank 0's first chunk)."""
    return hooks.entry("scoped", "DDP").made_by(lambda orig: unbucketed_ddp_class(wrap(orig)), on=module)


def unbucketed_ddp_class(ddp_class):
    """``ddp_class`` that builds every chunk with ``disable_bucketing=True`` (see `_unbucketed_ddp`;
    also Megatron-Bridge's ``_ddp_wrap``, ``bridge/model.py``)."""

    class UnbucketedDDP(ddp_class):
        def __init__(self, *args, **kwargs):
            kwargs["disable_bucketing"] = True
            super().__init__(*args, **kwargs)

    return UnbucketedDDP


def count_printer(built):
    """``print`` with Megatron's parameter-count line rewritten (`parameter_count_line`) once ``built`` has them."""

    def print_(*args, **kwargs):
        if len(args) == 1 and isinstance(args[0], str) and "chunks" in built:
            args = (parameter_count_line(args[0], built["chunks"]),)
        return builtins.print(*args, **kwargs)

    return print_


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

        if model_type is None:
            model_type = ModelType.encoder_or_decoder
        args = _megatron_args()
        schedule = schedule_of(args)
        if registry.get(schedule).chunks_per_rank != 2:
            return orig(model_provider_func, model_type, wrap_with_ddp, config=config, pg_collection=pg_collection)
        build_pair_groups(args)
        import megatron.training.training as mtraining

        built = {}
        provider = _two_chunk_provider(model_provider_func, schedule, model_type, built)
        swaps = [hooks.entry("scoped", "print").to(count_printer(built), on=mtraining)]
        if registry.get(schedule).mirrored:
            swaps.append(_unbucketed_ddp(mtraining, copies.chosen(args).wrap_ddp))
        with hooks.scoped(*swaps):
            model = orig(provider, model_type, wrap_with_ddp, config=config, pg_collection=pg_collection)
        return two_chunk_model_built(list(model), schedule)

    return get_model


def two_chunk_model_built(model, schedule: str):
    """The two chunks a model build returned, checked, the mirror marked for torch_dist, and one line
    per pipeline rank saying which stages it holds (get_model's path and 0.19's model builder)."""
    if len(model) != 2:
        raise RuntimeError(f"--pipeline-schedule {schedule}: expected 2 model chunks, got {len(model)}")
    if registry.get(schedule).mirrored:
        mark_mirror_replicas(model[1])  # torch_dist: the mirror is a non-main replica
    else:
        mark_v_tied_output_weight(model)  # torch_dist: written once, as the embedding
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
        print(f"[megatron-dualpipe] {schedule} pipeline rank {parallel_state.get_pipeline_model_parallel_rank()}: "
              f"{describe_chunks(model)}", flush=True)
    return model


def wrap_get_forward_backward_func(orig):
    @functools.wraps(orig)
    def get_forward_backward_func(*a, **kw):
        args = _megatron_args()
        schedule = schedule_of(args)
        if registry.get(schedule).runs_on == registry.MEGATRON:
            return orig(*a, **kw)
        from ..mcore.forward_backward import get_forward_backward_func as dispatch

        return dispatch(schedule, **forward_backward_options(args))

    return get_forward_backward_func


def wrap_setup_model_and_optimizer(orig):
    @functools.wraps(orig)
    def setup_model_and_optimizer(*a, **kw):
        args = _megatron_args()
        with copies.chosen(args).building_optimizer():
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

    from ..mcore import state_bytes

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
        args = _megatron_args()
        if not registry.get(schedule_of(args)).mirrored or not isinstance(model, list) or len(model) != 2:
            return orig(model, force_create_fp32_copy, *a, **kw)
        reads_main_params = bool(getattr(args, "bf16", False)) and not force_create_fp32_copy
        with copies.of(model).params_norm_chunks(model, reads_main_params) as chunks:
            return orig(chunks, force_create_fp32_copy, *a, **kw)

    return calc_params_l2_norm

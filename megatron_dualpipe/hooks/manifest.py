"""Every Megatron attribute megatron-dualpipe changes, in one list (the CPU mode's are in ``cpu/``),
grouped in :data:`PARTS` by who applies them: installed sets, ``scoped`` ones (inside one
``hooks.scoped(...)`` block of the module in ``where``) and ``instance`` ones (one object's attribute).
A change that differs between Megatron versions is two entries with disjoint ``versions``.
"""

from __future__ import annotations

from typing import Dict, Tuple

from .mechanism import INSTANCE, SCOPED, Patch, Versions, megatron_core_version

_ARGS = "megatron.training.arguments"
_INIT = "megatron.training.initialize"
_TRAINING = "megatron.training.training"
_CKPT = "megatron.training.checkpointing"
_PS = "megatron.core.parallel_state"
_LM = "megatron_dualpipe.megatron_lm."

# --- installed: Megatron-LM ------------------------------------------------------------------

ARGUMENTS = (
    Patch(_ARGS, "add_megatron_arguments", _LM + "arguments:wrap_add_megatron_arguments",
          "parse_args looks it up at call time: the --pipeline-schedule family joins every parser, whatever "
          "extra_args_provider the script passes"),
    Patch(_ARGS, "validate_args", _LM + "arguments:wrap_validate",
          "the DualPipe checks (megatron_lm/arguments.py) run right after Megatron's own, on the values it derives"),
    Patch(_INIT, "validate_args", _LM + "arguments:wrap_validate",
          "the by-name import initialize_megatron calls (0.19: parse_and_validate_args calls arguments' own)",
          versions=Versions(below="0.19")),
    Patch(_INIT, "validate_yaml", _LM + "arguments:wrap_validate",
          "--yaml-cfg runs are validated by it instead of validate_args", versions=Versions(below="0.19")),
    Patch("megatron.training.yaml_arguments", "validate_yaml", _LM + "arguments:wrap_validate",
          "--yaml-cfg runs are validated by it instead of validate_args (0.19 imports it at call time)",
          versions=Versions("0.19")),
)

TRAINING = (
    Patch(_ARGS, "core_transformer_config_from_args", _LM + "training_hooks:wrap_config_from_args",
          "--overlap-moe-expert-parallel-comm / --delay-wgrad-compute: megatron-core refuses them without a "
          "virtual pipeline; the config is built with them off and the combined step switched on after "
          "(mcore.overlap.enable_combined_step)"),
    Patch("megatron.training.argument_utils", "core_transformer_config_from_args",
          _LM + "training_hooks:wrap_config_from_args",
          "the same, where core_v0.19.0 defines it: pretrain_gpt.py's model config (gpt_config_from_args) calls it "
          "in this module, not through megatron.training.arguments", versions=Versions("0.19")),
    Patch(_TRAINING, "get_model", _LM + "training_hooks:wrap_get_model",
          "dualpipe / dualpipev: Megatron's own get_model builds both chunks of a rank (a provider returning "
          "the two), then the mirror is marked for torch_dist"),
    Patch(_TRAINING, "calc_params_l2_norm", _LM + "training_hooks:wrap_calc_params_l2_norm",
          "--log-params-norm under dualpipe: model[1] is the mirror, counted on its home rank"),
    Patch(_TRAINING, "get_forward_backward_func", _LM + "training_hooks:wrap_get_forward_backward_func",
          "every schedule but 1f1b returns the executor's forward_backward_func"),
    Patch(_TRAINING, "setup_model_and_optimizer", _LM + "training_hooks:wrap_setup_model_and_optimizer",
          "two-chunk schedules: rank 0 logs the bytes of parameters, gradients and optimizer state per pipeline "
          "rank against 1F1B's (mcore/state_bytes.py), once the model and the optimizer are built"),
    Patch(_TRAINING, "save_checkpoint", _LM + "checkpoint.hooks:wrap_save",
          "dualpipe / dualpipev checkpoints hold 1F1B's layout (megatron_lm/checkpoint/)"),
    Patch(_TRAINING, "load_checkpoint", _LM + "checkpoint.hooks:wrap_load",
          "loads 1F1B-layout checkpoints into both chunks, then copies home copies to mirrors"),
)

_SINCE_019 = Versions("0.19")
_BUILDER = "megatron.training.models.gpt"
_DIST_UTILS = "megatron.training.models.dist_utils"
_MODEL_BUILDER = "megatron_lm.model_builder (dualpipe, dualpipev; core_v0.19.0's model builder)"

#: core_v0.19.0 builds the model through GPTModelBuilder, not get_model (megatron_lm/model_builder.py).
MODEL_BUILDER = (
    Patch(_BUILDER, "unimodal_build_distributed_models",
          _LM + "model_builder:wrap_unimodal_build_distributed_models",
          "dualpipe / dualpipev at core_v0.19.0: pretrain_gpt.py builds the model through GPTModelBuilder, which "
          "calls this (by-name import) instead of get_model; both chunks of a rank are built here",
          versions=_SINCE_019),
)
MODEL_BUILDER_SCOPED = (
    Patch(_DIST_UTILS, "build_virtual_pipeline_stages", None, "builds the two chunks (build_two_direction_model) "
          "from the builder's build_model", versions=_SINCE_019, kind=SCOPED, where=_MODEL_BUILDER),
    Patch(_DIST_UTILS, "_ddp_wrap", None, "dualpipe: no chunk bucketed, so the two copies of a stage have one "
          "buffer layout (summed in place)", versions=_SINCE_019, kind=SCOPED, where=_MODEL_BUILDER),
    Patch(_DIST_UTILS, "_wrap_with_mp_wrapper", None, "dualpipev, --fp16/--bf16: each chunk's Float16Module gets "
          "the chunk's own config (two V-stages), as core_v0.16.1's get_model gives it; with the builder's config "
          "(no virtual stages) V-stage 1 on the last rank upcast its output to fp32 as if it were the last stage",
          versions=_SINCE_019, kind=SCOPED, where=_MODEL_BUILDER),
    Patch(_DIST_UTILS, "print", None, "the parameter-count line says the logical and physical counts",
          versions=_SINCE_019, kind=SCOPED, where=_MODEL_BUILDER),
    Patch(_DIST_UTILS, "DistributedDataParallel", None, "dualpipe: each chunk's DDP class as the way the copies are "
          "summed makes it (mcore/copies/: over the shard group with --dualpipe-shared-shard-group; the pair sums the "
          "shards after the reduce-scatter with --dualpipe-dp-first)", versions=_SINCE_019, kind=SCOPED, where=_MODEL_BUILDER),
)
V_CONFIG = Patch(_BUILDER, "GPTModelConfig.transformer", None,
                 "dualpipev: the builder's TransformerConfig is the dualpipev_config copy (two V-stages) while the "
                 "chunks are built", versions=_SINCE_019, kind=INSTANCE, where=_MODEL_BUILDER)

DATASET_HELPER = (
    Patch("megatron.core.datasets.utils", "compile_helpers", _LM + "dataset_helpers:replace_compile_helpers",
          "builds Megatron's dataset C++ helper with the running interpreter's headers and pybind11 "
          "(Megatron's Makefile asks python3-config, which may be another Python)"),
)

PYTHON = (
    Patch("typing", "override", _LM + "python_compat:typing_override",
          "Megatron-LM core_v0.19.0's megatron/training/models/{gpt,hybrid}.py import typing.override (Python "
          "3.12); on an older Python it is typing_extensions.override, as megatron-core itself uses",
          versions=Versions("0.19"), only_if_missing=True),
)

# --- installed: megatron-core ------------------------------------------------------------------

ZERO_BUBBLE = (
    Patch("megatron.core.tensor_parallel.layers", "LinearWithGradAccumulationAndAsyncCommunication.backward",
          "megatron_dualpipe.mcore.wgrad:deferrable_backward",
          "zero bubble: inside WeightGradStore.deferring() the local linears' weight GEMMs are queued for the "
          "W action; outside it the original backward runs unchanged"),
)

# --- scoped --------------------------------------------------------------------------------


def _scoped(module, attribute, why, where):
    return Patch(module, attribute, None, why, kind=SCOPED, where=where)


_DIRECTION = "mcore.direction.direction_of (while a direction-1 action runs)"
SCOPED_PATCHES = (
    _scoped(_PS, "is_pipeline_first_stage", "answers for the stage of the direction being computed "
            "(pretrain_gpt.get_batch reads tokens / labels by it)", _DIRECTION),
    _scoped(_PS, "is_pipeline_last_stage", "the same, for the last stage (loss, labels)", _DIRECTION),
    _scoped(_PS, "get_pipeline_model_parallel_next_rank", "swapped when the direction runs towards rank 0",
            _DIRECTION),
    _scoped(_PS, "get_pipeline_model_parallel_prev_rank", "swapped when the direction runs towards rank 0",
            _DIRECTION),
    _scoped(_PS, "get_pipeline_model_parallel_rank", "pp-1-i for DualPipe's direction 1", _DIRECTION),
    _scoped(_PS, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", "the mirror chunk is built as stage pp-1-i",
            "mcore.model.build_two_direction_model (while the mirror is built)"),
    _scoped(_PS, "_PIPELINE_GLOBAL_RANKS", "the mirror chunk is built with the reversed pipeline group",
            "mcore.model.build_two_direction_model (while the mirror is built)"),
    _scoped(_PS, "_PIPELINE_MODEL_PARALLEL_GROUP", "the mirror chunk's modules built without its pg_collection "
            "(0.16.1: the MTP layer's transformer layer) take the reversed pipeline group, and number their layers "
            "by its rank", "mcore.model.build_two_direction_model (while the mirror is built)"),
    _scoped(_PS, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", "DualPipeV's V-stages are megatron-core's two "
            "virtual stages: its layout (--pipeline-model-parallel-layout) reads the chunk's vp_stage only while "
            "parallel_state has a virtual pipeline", "mcore.model.build_two_direction_model (DualPipeV's two chunks)"),
    _scoped("megatron.core.pipeline_parallel.schedules", "forward_step_calc_loss",
            "the combined step asks is_pipeline_last_stage(), wrong for DualPipeV's direction 0 and DualPipe's "
            "direction 1: it is told where the forward's direction ends",
            "mcore.overlap.OverlappedStageCompute (one combined step)"),
    _scoped(_TRAINING, "get_megatron_optimizer", "--dualpipe-shared-shard-group: one optimizer per chunk over its "
            "shard group, chained in ascending stage order (mcore/copies/shared_shard.py)",
            "mcore.copies.shared_shard building_optimizer (in Megatron-LM's setup_model_and_optimizer)"),
) + tuple(
    _scoped(_PS, getter, "--dualpipe-shared-shard-group: the partial (one optimizer instance) data-parallel group "
            "megatron-core reduces a chunk's gradients over and shards its optimizer over is the chunk's shared "
            "shard group", "mcore.shard_groups.partial_groups_of (while one chunk's DDP or optimizer is built)")
    for getter in ("get_data_parallel_group", "get_data_parallel_group_gloo", "get_expert_data_parallel_group",
                   "get_expert_data_parallel_group_gloo")
) + (
    _scoped(_TRAINING, "DDP", "every DualPipe chunk unbucketed, so the two copies of a stage have one buffer "
            "layout (summed in place); the shared shard group's or dp-first's DDP class", "megatron_lm.training_hooks get_model (dualpipe)"),
    _scoped(_TRAINING, "print", "the parameter-count line says the logical and physical counts",
            "megatron_lm.training_hooks get_model (dualpipe, dualpipev)"),
    _scoped(_CKPT, "_load_base_checkpoint", "dualpipev loading a 1F1B-layout file: its model is cut into the "
            "two V-stages", "megatron_lm.checkpoint.megatron_io (dualpipev load of a one-chunk torch file)"),
    _scoped(_CKPT, "generate_state_dict", "dualpipe torch_dist: the mirror's entries are left out; dualpipev "
            "torch: 1F1B stage i's weights are added as 'model'", "megatron_lm.checkpoint.megatron_io (save)"),
) + tuple(
    Patch("megatron.core.pipeline_parallel.utils", attribute, None, why, kind=SCOPED, versions=versions,
          where="selftest.overlap.NodeTimer (one measured iteration of the overlap stage)")
    for attribute, why, versions in (
        ("ScheduleNode.stream_acquire_context", "times each schedule node of a fused F&B unit on its stream",
         _SINCE_019),
        ("stream_acquire_context", "times each schedule node of a fused F&B unit on its stream",
         Versions(below="0.19")),
        ("ScheduleNode._forward", "names the node being timed (0.16's stream_acquire_context has no node)",
         Versions(below="0.19")),
        ("ScheduleNode._backward", "names the node being timed (0.16's stream_acquire_context has no node)",
         Versions(below="0.19")),
    )
)

# --- per object ------------------------------------------------------------------------------

INSTANCE_PATCHES = (
    Patch("megatron.core.models.gpt.gpt_model", "GPTModel.sharded_state_dict", None,
          "DualPipe's mirror chunk (DualPipeV: the tied output weight on rank 0): every such sharded entry is a "
          "non-main replica, so torch_dist never writes it",
          kind=INSTANCE,
          where="megatron_lm.checkpoint.torch_dist_mirror.mark_mirror_replicas (model[1], for its life)"),
    Patch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.sharded_state_dict", None,
          "torch_dist under dualpipe: the dp_reshardable state holds model[0]'s grad buffers only (1F1B's keys)",
          kind=INSTANCE, where="megatron_lm.checkpoint.torch_dist_mirror (one save / load)"),
    Patch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_parameter_state_from_dp_reshardable",
          None, "the mirror's grad buffers keep their values; sync_mirrors fills them after the load",
          kind=INSTANCE, where="megatron_lm.checkpoint.torch_dist_mirror (one load)"),
    Patch("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer.param_index_map", None,
          "megatron-core's fully reshardable optimizer state slices the gathered state (the padding between "
          "buckets removed) at the padded offsets: a parameter after a padded bucket (the tied embedding's own "
          "bucket: DualPipeV's V-stage 0) is written shifted by that padding; offsets without it (megatron-core's "
          "bug, 1F1B's too)", kind=INSTANCE,
          where="megatron_lm.checkpoint.optimizers.exact_offsets (dualpipe / dualpipev torch_dist save and load; "
                "Bridge's too)"),
)

#: part -> its entries. The installed parts in the order they are installed.
PARTS: Dict[str, Tuple[Patch, ...]] = {
    "python": PYTHON,
    "megatron-lm arguments": ARGUMENTS,
    "megatron-lm training": TRAINING,
    "megatron-lm model builder": MODEL_BUILDER,
    "megatron-lm dataset helper": DATASET_HELPER,
    "zero bubble": ZERO_BUBBLE,
    "scoped": SCOPED_PATCHES + MODEL_BUILDER_SCOPED,
    "per object": INSTANCE_PATCHES + (V_CONFIG,),
}

#: What ``megatron_lm.install.install()`` installs.
MEGATRON_LM_PARTS = ("python", "megatron-lm arguments", "megatron-lm training", "megatron-lm model builder",
                     "megatron-lm dataset helper")
#: The parts that ``hooks.install`` applies as a set.
INSTALLED_PARTS = MEGATRON_LM_PARTS + ("zero bubble",)


def entry(part: str, attribute: str) -> Patch:
    """The entry of ``part`` for ``attribute`` (the name after the module); where entries for
    several megatron-core versions exist, the one for the installed version."""
    found = [p for p in PARTS[part] if p.attribute == attribute]
    if len(found) > 1:
        found = [p for p in found if megatron_core_version() in p.versions]
    if len(found) != 1:
        raise KeyError(f"{part!r} has {len(found)} entries for {attribute!r}")
    return found[0]

"""Every attribute of Megatron-Bridge the adapter replaces while a two-chunk schedule is enabled, with
why (the same mechanism and form as ``hooks/manifest.py``'s Megatron entries; installed as one set by
:mod:`.switch`, undone by ``disable``)."""
from __future__ import annotations

from typing import Tuple

from ..hooks.mechanism import INSTANCE, SCOPED, Patch
from ..schedule import registry
from .version_gate import CORE_OF_BRIDGE_03, CORE_OF_BRIDGE_06

_TRAINING = "megatron.bridge.training"
_PROVIDER = "megatron.bridge.models.model_provider"
_CHECKPOINTING = _TRAINING + ".checkpointing"
_HERE = "megatron_dualpipe.bridge."

#: Both two-chunk schedules (the checkpoint entries by Bridge series: 0.3 calls ``save_checkpoint`` /
#: ``load_checkpoint`` by name from train, pretrain and setup, 0.6 through its ``DefaultCheckpointManager``).
COMMON: Tuple[Patch, ...] = (
    Patch(_TRAINING + ".train", "get_forward_backward_func", _HERE + "schedule:wrap_get_forward_backward_func",
          "train() imports megatron-core's by name and calls it with pp_size / vp_size: the executor's schedule"),
    Patch(_TRAINING + ".eval", "get_forward_backward_func", _HERE + "schedule:wrap_get_forward_backward_func",
          "evaluate() imports it by name too: the executor's schedule, forward only"),
    Patch(_PROVIDER, "_create_model", _HERE + "model:wrap_create_model",
          "get_model's raw chunks (looked up at call time): both chunks of the rank through the provider's provide()"),
    Patch(_TRAINING + ".train", "save_checkpoint", _HERE + "checkpoint:wrap_save_checkpoint",
          "save_checkpoint_and_time calls it by name: torch_dist in 1F1B's keys (megatron_lm.checkpoint's strategies)",
          versions=CORE_OF_BRIDGE_03),
    Patch(_TRAINING + ".pretrain", "save_checkpoint", _HERE + "checkpoint:wrap_save_checkpoint",
          "pretrain() saves once more after training by name: without it that last checkpoint held the "
          "distributed optimizer's state shifted past a padded bucket (DualPipeV)", versions=CORE_OF_BRIDGE_03),
    Patch(_TRAINING + ".setup", "load_checkpoint", _HERE + "checkpoint:wrap_load_checkpoint",
          "setup() loads by name: DualPipe's mirrors synced from their home copies after the load",
          versions=CORE_OF_BRIDGE_03),
    Patch(_CHECKPOINTING, "save_checkpoint", _HERE + "checkpoint:wrap_save_checkpoint",
          "Bridge 0.6: DefaultCheckpointManager.save calls it (looked up at call time): torch_dist in 1F1B's keys",
          versions=CORE_OF_BRIDGE_06),
    Patch(_CHECKPOINTING, "load_checkpoint", _HERE + "checkpoint:wrap_load_checkpoint",
          "Bridge 0.6: DefaultCheckpointManager.load calls it: DualPipe's mirrors synced from home after the load",
          versions=CORE_OF_BRIDGE_06),
)
#: DualPipe only (mirrored copies).
MIRRORED: Tuple[Patch, ...] = (
    Patch(_PROVIDER, "DistributedDataParallel", _HERE + "model:unbucketed_ddp",
          "_ddp_wrap buckets chunk 0 only: both copies of a stage are summed in place and need one buffer layout",
          versions=CORE_OF_BRIDGE_03),
    Patch("megatron.training.models.dist_utils", "DistributedDataParallel", _HERE + "model:unbucketed_ddp",
          "Bridge 0.6's _ddp_wrap is megatron-core 0.19's (megatron.training): chunk 0 bucketed, as above",
          versions=CORE_OF_BRIDGE_06),
    Patch(_TRAINING + ".train", "calc_params_l2_norm", _HERE + "schedule:wrap_calc_params_l2_norm",
          "logger.log_params_norm: the mirror's parameters are counted once, at home"),
)


#: DualPipeV only (the provider says two virtual stages from the model build on).
V_STAGES: Tuple[Patch, ...] = (
    Patch(_TRAINING + ".setup", "setup_data_iterators", _HERE + "switch:without_v_stages",
          "it builds one data iterator per virtual stage: one, which the executor splits into the directions"),
)


def for_schedule(schedule: str) -> Tuple[Patch, ...]:
    """The patches ``schedule`` needs (none for Bridge's own 1f1b)."""
    if registry.get(schedule).chunks_per_rank != 2:
        return ()
    return COMMON + (MIRRORED if registry.get(schedule).mirrored else V_STAGES)


#: Bridge's state dict of a save, the mirror's entries left out (``bridge.checkpoint``, during a save).
GENERATE_STATE_DICT = Patch(_CHECKPOINTING, "generate_state_dict", None,
                            "dualpipe / dualpipev torch_dist: the mirror's entries (non-main replicas) are not written",
                            kind=SCOPED, where="bridge.checkpoint.wrap_save_checkpoint")


# --- per object (the recipe's model provider, which is also the chunks' TransformerConfig) -------------

#: The provider's process groups, which ``provide()`` reads (``self._pg_collection``): the mirror's
#: for the time it is built.
PROVIDER_GROUPS = Patch("megatron.bridge.models.gpt_provider", "GPTModelProvider._pg_collection", None,
                        "the chunk's pg_collection (the mirror's: the reversed pipeline group) while provide() builds it",
                        kind=INSTANCE, where="bridge.model.wrap_create_model (one chunk)")
#: DualPipeV: the provider (the chunks' TransformerConfig) says two virtual stages while the run lasts.
PROVIDER_V_STAGES = Patch("megatron.bridge.models.gpt_provider", "GPTModelProvider.virtual_pipeline_model_parallel_size",
                          None, "dualpipev: the V-stages are megatron-core's two virtual stages (the chunks' config; "
                          "parallel_state has none)", kind=INSTANCE, where="bridge.switch (dualpipev, for the run)")


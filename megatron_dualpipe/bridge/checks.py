"""What a Bridge ``ConfigContainer`` asks that DualPipe / DualPipeV cannot run, found before anything
starts, each problem naming the config field to change (joined into one line by :func:`check`).

The megatron-core options come from the one options table (``mcore.options``), read on
``cfg.model`` (a ``TransformerConfig``) and ``cfg.ddp``; the schedule's own rules (pipeline size,
layers, micro-batches) from the registry; the rest are Bridge paths the adapter does not run yet.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

from .. import versions
from ..mcore import options
from ..mcore.validation import DualPipeConfigError
from ..schedule import registry

#: The schedules the adapter runs (``1f1b``: Bridge's own, untouched).
SCHEDULES = (registry.DUALPIPE, registry.DUALPIPEV, registry.DEFAULT)
_MISSING = object()

#: (field, refused when, why and what to set) for the Bridge paths the adapter does not run.
NOT_RUN: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ("model.virtual_pipeline_model_parallel_size", lambda v: v is not None,
     "DualPipe builds its own two chunks per rank (DualPipeV's V-stages are its two virtual stages): set it to None"),
    ("dist.use_decentralized_pg", bool, "the executor runs on megatron-core's parallel_state groups: set it to False"),
    ("dist.use_megatron_fsdp", bool, "FSDP shards what DualPipe keeps as two chunks: set it to False"),
    ("dist.use_torch_fsdp2", bool, "FSDP shards what DualPipe keeps as two chunks: set it to False"),
    ("inprocess_restart.enabled", bool, "in-process restart is not run under DualPipe: set it to False"),
    ("checkpoint.ckpt_format", lambda v: v != "torch_dist",
     "Bridge's checkpoints under DualPipe are written and read in 1F1B's keys in torch_dist only: set it to "
     "'torch_dist'"),
    ("checkpoint.async_save", bool, "the save's edits (the mirror left out) are not run in the async worker: set it "
     "to False"),
    ("checkpoint.non_persistent_save_interval", lambda v: v is not None,
     "local (non-persistent) checkpoints of the two chunks are not done: set it to None"),
    ("checkpoint.pretrained_checkpoint", lambda v: v is not None,
     "loading into the two chunks is not done for Bridge yet: set it to None"),
    ("peft", lambda v: v is not None, "PEFT's pre-wrap hook has not run on two chunks: set it to None"),
    ("comm_overlap.overlap_moe_expert_parallel_comm", bool,
     "Bridge's CommOverlapConfig asserts a virtual pipeline for it; the fused F&B units through Bridge are not "
     "done yet: set it to False"),
    ("comm_overlap.delay_wgrad_compute", bool, "goes with the fused F&B units, not done through Bridge yet: set it "
     "to False"),
    ("model.num_layers_in_first_pipeline_stage", lambda v: v is not None,
     "uneven stages through Bridge are not done yet: set it to None"),
    ("model.num_layers_in_last_pipeline_stage", lambda v: v is not None,
     "uneven stages through Bridge are not done yet: set it to None"),
    ("model.account_for_embedding_in_pipeline_split", bool, "uneven stages through Bridge are not done yet: set "
     "it to False"),
    ("model.account_for_loss_in_pipeline_split", bool, "uneven stages through Bridge are not done yet: set it to "
     "False"),
    ("model.pipeline_model_parallel_layout", lambda v: v is not None,
     "a layout through Bridge is not done yet: set it to None (even stages)"),
    ("model.cuda_graph_scope", lambda v: "full_iteration" in str(v),
     "a full-iteration CUDA graph captures Bridge's one-schedule call: remove full_iteration"),
)  # fmt: skip


class BridgeConfigError(DualPipeConfigError):
    """A Bridge configuration DualPipe cannot run, found before training (one line)."""


def field(cfg, path: str):
    """``cfg.a.b`` for ``"a.b"``; a missing part gives :data:`_MISSING` (not refused)."""
    value = cfg
    for part in path.split("."):
        value = getattr(value, part, _MISSING) if value is not None else _MISSING
        if value is _MISSING:
            return _MISSING
    return value


def problems(cfg, schedule: str, world_size: int, options: Optional[dict] = None) -> List[str]:
    """Every problem of ``cfg`` under ``schedule`` (with the executor's ``options``) on ``world_size``
    processes (empty for 1f1b)."""
    if schedule not in SCHEDULES:
        return [f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}"]
    if schedule == registry.DEFAULT:
        return []
    spec = registry.get(schedule)
    found = [f"{path}={value!r}: {why}" for path, refused, why in NOT_RUN
             for value in [field(cfg, path)] if value is not _MISSING and refused(value)]
    if not _is_gpt(cfg.model):
        found.append(f"model: a {type(cfg.model).__name__} (DualPipe runs GPT providers through Bridge: "
                     f"GPTModelProvider and its Llama / Qwen / DeepSeek subclasses)")
    torch_problem = versions.torch_problem()
    if torch_problem:
        found.append(f"torch: {torch_problem}, or schedule='1f1b'")
    return (found + _mtp_problems(spec.name, cfg, options or {}) + _pipeline_problems(spec, cfg, world_size)
            + _option_problems(spec.name, cfg))


def _mtp_problems(schedule: str, cfg, options: dict) -> List[str]:
    """DualPipeV's zero-bubble split with MTP: measured off 1F1B (tests/bridge, the MoE case)."""
    layers = getattr(cfg.model, "mtp_num_layers", None) or 0
    if schedule != registry.DUALPIPEV or not layers or not options.get("zero_bubble", True):
        return []
    return [f"model.mtp_num_layers={layers} with the executor's zero_bubble=True: under dualpipev the MTP stage's "
            f"embedding gradient (rank 0, beside stage 0's) comes out up to 5e-5 off Bridge's 1F1B with the weight "
            f"gradients split off (equal without): pass zero_bubble=False to pretrain / enable"]


def _is_gpt(model) -> bool:
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    return isinstance(model, GPTModelProvider)


def _pipeline_problems(spec, cfg, world_size: int) -> List[str]:
    """Pipeline size, layers per stage and micro-batches per step, by the registry's rules."""
    model, train = cfg.model, cfg.train
    pp = model.pipeline_model_parallel_size
    if pp < 2 or spec.pp_problem(pp):
        return [spec.pp_problem(pp, flag="model.pipeline_model_parallel_size")
                or f"model.pipeline_model_parallel_size={pp}: {spec.name} needs a pipeline of at least 2 ranks"]
    found, stages = [], spec.model_stages(pp)
    if model.num_layers % stages:
        found.append(f"model.num_layers={model.num_layers}: {spec.name} splits the layers into {stages} equal stages "
                     f"at pipeline size {pp}: make it a multiple of {stages}")
    least, per_step = spec.min_real_microbatches(pp), train.micro_batch_size * _data_parallel_size(cfg.model, world_size)
    starts = [("train.global_batch_size", train.global_batch_size)]
    if train.rampup_batch_size:
        starts.append(("train.rampup_batch_size[0]", int(train.rampup_batch_size[0])))
    for name, batch in starts:
        if batch // per_step < least:
            found.append(f"{name}={batch}: {batch // per_step} micro-batches per step (micro_batch_size "
                         f"{train.micro_batch_size} x data-parallel {per_step // train.micro_batch_size}), {spec.name} "
                         f"needs at least {least} at pipeline size {pp}: raise it to {least * per_step}")
    return found


def _data_parallel_size(model, world_size: int) -> int:
    return max(1, world_size // (model.tensor_model_parallel_size * model.pipeline_model_parallel_size
                                 * (model.context_parallel_size or 1)))


def _option_problems(schedule: str, cfg) -> List[str]:
    """The options table's rules on ``cfg.model`` (a TransformerConfig) and ``cfg.ddp``."""
    found = []
    for rule in options.REFUSED:
        if schedule not in rule.schedules or rule.needs:
            continue
        for side, source, prefix in ((options.CONFIG, cfg.model, "model"), (options.DDP, cfg.ddp, "ddp")):
            value = rule.value(source, side) if rule.applies(side) else None
            if rule.applies(side) and rule.is_set(value):
                found.append(f"{_field_of(rule, side, prefix)}={value!r}: {rule.why}{_default_of(source, rule.config)}")
    return found


def _field_of(rule, side: str, prefix: str) -> str:
    if side == options.CONFIG and rule.config:
        return f"{prefix}.{rule.config}"
    if side == options.DDP:  # the DDP rules are one-option flags
        return f"{prefix}.{rule.flag.lstrip('-').replace('-', '_')}"
    return f"{prefix} ({rule.flag})"


def _default_of(source, name) -> str:
    fields = {f.name: f for f in dataclasses.fields(source)} if dataclasses.is_dataclass(source) else {}
    f = fields.get(name)
    if f is None or f.default is dataclasses.MISSING:
        return ""
    return f": set it to {f.default!r}"


def check(cfg, schedule: str, world_size: int, options: Optional[dict] = None) -> None:
    """Raise :class:`BridgeConfigError` naming every problem, in one line."""
    from . import version_gate

    found = version_gate.problems() + problems(cfg, schedule, world_size, options)
    if found:
        raise BridgeConfigError(f"megatron_dualpipe.bridge {schedule}: " + "; ".join(found))

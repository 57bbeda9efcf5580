"""``save_checkpoint`` / ``load_checkpoint`` of ``megatron.training.training``, wrapped (the hooks
manifest installs them): each call looks up its (schedule, format) strategy (:mod:`.strategies`),
the format of a load the one of the checkpoint it is about to read (read before anything is loaded)."""

import functools
import os

from ...schedule import registry
from ..arguments import schedule_of
from . import strategies


def wrap_save(orig):
    """Megatron's ``save_checkpoint`` through the strategy of (``--pipeline-schedule``, ``--ckpt-format``)."""

    @functools.wraps(orig)
    def save_checkpoint(iteration, model, optimizer, *a, **kw):
        from megatron.training import get_args

        args = get_args()
        save = strategies.save_strategy(schedule_of(args), args.ckpt_format)
        return save(orig, args, iteration, model, optimizer, *a, **kw)

    return save_checkpoint


def wrap_load(orig):
    """Megatron's ``load_checkpoint`` through the strategy of (``--pipeline-schedule``, the format
    of the checkpoint it is about to read)."""

    @functools.wraps(orig)
    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, **kw):
        from megatron.training import get_args

        args = get_args()
        schedule = schedule_of(args)
        fmt = disk_format(args, load_arg)
        file = peek_torch_checkpoint(args, load_arg) if fmt == "torch" else None
        strategies.refuse_optimizer_across_layouts(args, optimizer, schedule, file)
        strategies.refuse_unreadable_format(ddp_model, fmt)
        load = strategies.load_strategy(schedule, fmt)
        return load(orig, args, ddp_model, optimizer, file, opt_param_scheduler, load_arg, strict, **kw)

    return load_checkpoint


def _checkpoint_name(args, load_arg, **kw):
    """The path load_checkpoint will read (``get_checkpoint_name``'s), or None without a tracker file."""
    import megatron.training.checkpointing as mckpt

    load_dir = getattr(args, load_arg, None)
    tracker = mckpt.get_checkpoint_tracker_filename(load_dir) if load_dir else None
    if not tracker or not os.path.isfile(tracker):
        return None
    iteration, release = mckpt.read_metadata(tracker)
    if getattr(args, "ckpt_step", None):
        iteration = args.ckpt_step
    return mckpt.get_checkpoint_name(load_dir, iteration, release, **kw)


def disk_format(args, load_arg):
    """'torch_dist' if the checkpoint that load_checkpoint will read is a distributed one, else
    the format it will be read as (args.ckpt_format when nothing can be found)."""
    try:
        from megatron.core import dist_checkpointing

        name = _checkpoint_name(args, load_arg, return_base_dir=True)
        if name is None:
            return args.ckpt_format
        return "torch_dist" if dist_checkpointing.check_is_distributed_checkpoint(name) else "torch"
    except Exception:  # noqa: BLE001 - detection is best effort; Megatron reports real errors
        return args.ckpt_format


def peek_torch_checkpoint(args, load_arg):
    """(top-level keys, schedule that wrote it) of this rank's torch-format file that
    load_checkpoint will read, or None when there is none (memory-mapped, tensors not read)."""
    import torch

    name = _checkpoint_name(args, load_arg)
    if name is None or not os.path.isfile(name):
        return None
    sd = torch.load(name, map_location="cpu", weights_only=False, mmap=True)
    return set(sd), getattr(sd.get("args"), "pipeline_schedule", registry.DEFAULT) or registry.DEFAULT

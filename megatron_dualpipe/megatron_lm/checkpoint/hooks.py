"""``save_checkpoint`` / ``load_checkpoint`` of ``megatron.training.training``, wrapped (the hooks
manifest installs them): each call looks up its (schedule, format) strategy (:mod:`.strategies`)."""

import functools

from ..arguments import schedule_of
from . import files, strategies


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
        fmt = files.disk_format(args, load_arg)
        file = files.peek_torch_checkpoint(args, load_arg) if fmt == "torch" else None
        strategies.refuse_optimizer_across_layouts(args, optimizer, schedule, file)
        strategies.refuse_unreadable_format(ddp_model, fmt)
        load = strategies.load_strategy(schedule, fmt)
        return load(orig, args, ddp_model, optimizer, file, opt_param_scheduler, load_arg, strict, **kw)

    return load_checkpoint

"""The ``forward_backward_func`` Bridge's training and evaluation loops get under DualPipe / DualPipeV.

Bridge imports megatron-core's ``get_forward_backward_func`` by name into ``training/train.py`` and
``training/eval.py`` and calls it with ``pp_size=`` / ``vp_size=``; :func:`wrap_get_forward_backward_func`
replaces those names. What it returns is the package's executor schedule
(``mcore.forward_backward.get_forward_backward_func``) behind :class:`BridgeCall`, which takes Bridge's
call as it comes: ``p2p_communicator`` and ``pg_collection`` (the executor communicates over
parallel_state's groups, which are Bridge's unless ``dist.use_decentralized_pg``, refused before training),
and one data iterator per chunk where Bridge builds a list (``make_data_iterator_list``: the first reads,
the others replay it), of which the executor takes the first and splits it into the directions itself.
"""
from __future__ import annotations

import functools
from typing import Any, Dict

from ..schedule import registry
from ..schedule.layout import BIDIRECTIONAL


class BridgeCall:
    """One ``forward_backward_func`` call of Bridge's, handed to the executor's schedule."""

    def __init__(self, schedule: str, options: Dict[str, Any]):
        from ..mcore.forward_backward import get_forward_backward_func

        self.schedule = schedule
        self.func = get_forward_backward_func(schedule, **options)

    def __call__(self, *, data_iterator=None, p2p_communicator=None, pg_collection=None, **kwargs):
        _check_groups(self.schedule, pg_collection)
        if isinstance(data_iterator, (list, tuple)):
            data_iterator = data_iterator[0]
        return self.func(data_iterator=data_iterator, **kwargs)


def _check_groups(schedule: str, pg_collection) -> None:
    from megatron.core import parallel_state

    from .checks import BridgeConfigError

    if pg_collection is not None and pg_collection.pp is not parallel_state.get_pipeline_model_parallel_group():
        raise BridgeConfigError(f"megatron_dualpipe.bridge {schedule}: Bridge passed process groups other than "
                                f"megatron-core's parallel_state ones: set dist.use_decentralized_pg to False")


def wrap_get_forward_backward_func(orig):
    """Bridge's by-name ``get_forward_backward_func``: the executor's under a two-chunk schedule."""

    @functools.wraps(orig)
    def get_forward_backward_func(*args, **kwargs):
        from . import switch

        schedule = switch.active_schedule()
        if schedule is None or registry.get(schedule).runs_on != registry.EXECUTOR:
            return orig(*args, **kwargs)
        return BridgeCall(schedule, switch.active_options())

    return get_forward_backward_func


def wrap_calc_params_l2_norm(orig):
    """``logger.log_params_norm`` under DualPipe: model[1] holds mirrored copies, counted once at home
    (the copy-sum way's ``params_norm_chunks``, ``mcore.copies``, as the Megatron-LM hook does)."""

    @functools.wraps(orig)
    def calc_params_l2_norm(model, model_config, *args, **kwargs):
        from ..mcore.model import chunk_info
        from ..mcore.copies import of

        info = chunk_info(model[0]) if isinstance(model, list) and len(model) == 2 else None
        if info is None or info["layout"] != BIDIRECTIONAL:
            return orig(model, model_config, *args, **kwargs)
        reads_main_params = bool(model_config.bf16) and not kwargs.get("force_create_fp32_copy", False)
        with of(model).params_norm_chunks(model, reads_main_params) as chunks:
            return orig(chunks, model_config, *args, **kwargs)

    return calc_params_l2_norm

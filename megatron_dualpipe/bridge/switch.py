"""Switch DualPipe / DualPipeV on for Megatron-Bridge's ``pretrain()``: the one call a recipe adds.

:func:`enable` checks the ``ConfigContainer`` (every problem in one line naming its field, before
anything starts), then installs :mod:`.patches` for the schedule as one set; :func:`disable` puts
every Bridge attribute back (and the provider's virtual stages under DualPipeV). Idempotent: the same
call twice changes nothing; another schedule replaces the first. ``1f1b`` installs nothing: Bridge
runs exactly as without the package.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

from .. import hooks
from ..hooks.mechanism import PatchSet, apply, restore
from ..schedule import registry
from . import checks, patches
from .patches import PROVIDER_V_STAGES

_STATE: Dict[str, Any] = {}  # schedule, options, config, patches; "v_stages": the provider's Applied
#: The executor's options a caller may give (``mcore.forward_backward.get_forward_backward_func``).
OPTIONS = ("zero_bubble", "p2p_timeout", "advise", "advise_warmup", "drift_check_every")


def enable(config, schedule: str = registry.DUALPIPE, **options) -> None:
    """Run ``config``'s next ``megatron.bridge.training.pretrain.pretrain`` under ``schedule``."""
    from megatron.bridge.utils.common_utils import get_world_size_safe

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise checks.BridgeConfigError(f"megatron_dualpipe.bridge: unknown option(s) {', '.join(unknown)}: "
                                       f"choose from {', '.join(OPTIONS)}")
    if schedule != registry.DEFAULT:
        checks.check(config, schedule, get_world_size_safe(), options)
    wanted = dict(schedule=schedule, options=_executor_options(config, options))
    if _STATE.get("config") is config and all(_STATE[k] == v for k, v in wanted.items()):
        return
    disable()
    if schedule == registry.DEFAULT:
        return
    installed = PatchSet(f"megatron-bridge {schedule}", patches.for_schedule(schedule))
    installed.install()
    _STATE.update(wanted, config=config, patches=installed)


def _executor_options(config, options) -> Dict[str, Any]:
    """The executor's options; the P2P deadline defaults to Bridge's ``dist.distributed_timeout_minutes``."""
    out = dict(options)
    minutes = getattr(getattr(config, "dist", None), "distributed_timeout_minutes", None)
    if "p2p_timeout" not in out and minutes:
        out["p2p_timeout"] = float(minutes) * 60.0
    return out


def disable() -> List[str]:
    """Undo :func:`enable`; returns the attributes someone else had replaced meanwhile (restored anyway)."""
    overwritten: List[str] = []
    applied = _STATE.pop("v_stages", None)
    if applied is not None and not restore(applied):
        overwritten.append(applied.patch.target)
    installed = _STATE.pop("patches", None)
    if installed is not None:
        overwritten += installed.uninstall()
        from ..mcore import groups

        groups.destroy_bd_groups()  # Bridge's pretrain destroys parallel_state when it ends: a next one rebuilds both
    _STATE.clear()
    return overwritten


def active_schedule() -> Optional[str]:
    """The enabled two-chunk schedule, or None."""
    return _STATE.get("schedule")


def active_options() -> Dict[str, Any]:
    return dict(_STATE.get("options", {}))


def with_v_stages(provider) -> None:
    """DualPipeV, once parallel_state exists (without a virtual pipeline): the provider, which is the
    chunks' TransformerConfig, says two virtual stages from the model build to :func:`disable`."""
    if active_schedule() == registry.DUALPIPEV and "v_stages" not in _STATE:
        _STATE["v_stages"] = apply(PROVIDER_V_STAGES.to(2, on=provider))


def without_v_stages(func):
    """``func(cfg, ...)`` with ``cfg.model`` saying no virtual stage (Bridge's ``setup_data_iterators``
    builds one iterator per virtual stage; the executor reads one and splits it itself)."""

    @functools.wraps(func)
    def call(cfg, *args, **kwargs):
        if "v_stages" not in _STATE:
            return func(cfg, *args, **kwargs)
        with hooks.scoped(PROVIDER_V_STAGES.to(None, on=cfg.model)):
            return func(cfg, *args, **kwargs)

    return call


def pretrain(config, forward_step_func, callbacks=None, *, schedule: str = registry.DUALPIPE, **options):
    """Drop-in for ``megatron.bridge.training.pretrain.pretrain`` with ``schedule`` (``dualpipe``,
    ``dualpipev`` or ``1f1b``); the package's patches are undone when it returns."""
    from megatron.bridge.training.pretrain import pretrain as bridge_pretrain

    enable(config, schedule, **options)
    try:
        return bridge_pretrain(config, forward_step_func, callbacks=callbacks)
    finally:
        disable()

"""DualPipe and DualPipeV for Megatron-Bridge (NVIDIA's recipes: ``megatron.bridge.training.pretrain``).

The one-line change in a recipe script::

    from megatron_dualpipe.bridge import pretrain        # instead of megatron.bridge.training.pretrain's
    pretrain(config, forward_step, schedule="dualpipe")  # or "dualpipev"; "1f1b" is Bridge's own

or ``enable(config, "dualpipe")`` before Bridge's own ``pretrain(config, forward_step)``.

* :mod:`.switch`: ``enable`` / ``disable`` / the drop-in ``pretrain``;
* :mod:`.checks`: what is refused before training, one line naming the config fields;
* :mod:`.patches`: every Bridge attribute replaced, and why; :mod:`.model` builds the two chunks
  through the recipe's provider, :mod:`.schedule` hands Bridge's calls to the executor,
  :mod:`.checkpoint` routes Bridge's torch_dist save / load through Megatron-LM's strategies (1F1B's keys);
* :mod:`.version_gate`: the Bridge releases it knows; :mod:`.cpu`: the CPU mode's redirections for
  Bridge's training loop (tests on gloo).

Bridge is imported only when these are called.
"""
from __future__ import annotations

from ..schedule.registry import DUALPIPE

__all__ = ["pretrain", "enable", "disable"]


def pretrain(config, forward_step_func, callbacks=None, *, schedule: str = DUALPIPE, **options):
    """See :func:`.switch.pretrain`."""
    from .switch import pretrain as run

    return run(config, forward_step_func, callbacks, schedule=schedule, **options)


def enable(config, schedule: str = DUALPIPE, **options) -> None:
    """See :func:`.switch.enable`."""
    from .switch import enable as switch_on

    switch_on(config, schedule, **options)


def disable():
    """See :func:`.switch.disable`."""
    from .switch import disable as switch_off

    return switch_off()

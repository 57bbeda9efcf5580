"""A short batch padded with fake micro-batches: which actions are padding, and where the real
ones sit in the global batch.

An order needs a least number of micro-batches (DualPipe: an even count >= 2*pp). Training with
fewer runs the order for ``ScheduleSpec.padded_microbatches`` and makes the extra ones fakes: no
data, no compute, zero loss and gradient; their sends still carry zeros, so the communication plan
is the order's own. Standard library only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

from .actions import Action
from .registry import Schedule, ScheduleError, build_schedule
from .registry import spec as get
from .simulate import Costs, PaddedCosts


@dataclass(frozen=True)
class Padded:
    """A schedule built for ``real`` micro-batches, padded with fakes where the order needs more."""

    schedule: Schedule
    real: int

    @property
    def fake_count(self) -> int:
        return self.schedule.microbatches - self.real

    def is_fake(self, a: Action) -> bool:
        """Whether ``a`` works on a fake micro-batch (no data, no compute)."""
        return self.schedule.spec.is_fake(self.real, a.dir, a.mb)

    def global_index(self, a: Action) -> Optional[int]:
        """The index in the global batch of ``a``'s micro-batch; None for a fake."""
        return None if self.is_fake(a) else self.schedule.spec.global_index(self.real, a.dir, a.mb)

    def padding(self, actions: Tuple[Action, ...]) -> Tuple[bool, ...]:
        """:meth:`is_fake` of each of ``actions`` (a rank's list)."""
        return tuple(self.is_fake(a) for a in actions)

    def costs(self, costs: Costs) -> Costs:
        """``costs`` with the fake micro-batches free (unchanged when nothing is padded)."""
        return PaddedCosts.wrap(costs, self.is_fake) if self.fake_count else costs


@functools.lru_cache(maxsize=16)
def build_padded(name: str, pp: int, real: int, forward_only: bool = False) -> Padded:
    """The schedule the executor runs for ``real`` micro-batches (:class:`ScheduleError` if none).
    Cached (a ``Padded`` is immutable): advise times one schedule under dozens of costs and
    bandwidths while it looks for a break-even point."""
    spec = get(name)
    problem = spec.pp_problem(pp)
    if problem:
        raise ScheduleError(problem)
    return Padded(build_schedule(name, pp, spec.padded_microbatches(pp, real, forward_only)), real)

"""What the runner tells the code that watches a rank's schedule run.

What must happen at a point of the schedule without being part of running it (a timeline, a chunk's
gradient reduction) is a :class:`RunListener` handed to ``run_rank``, called in schedule order once per
unit (one action, or an overlapped F with its backward): the hot path, so keep the hooks cheap.
"""
from __future__ import annotations

from typing import Tuple

from ..schedule.actions import Action

Unit = Tuple[int, ...]


class RunListener:
    """Hooks of one ``run_rank`` call; each does nothing unless overridden."""

    def on_unit_waiting(self, unit: Unit) -> None:
        """The unit's batch of P2P is posted; the runner now waits for its inputs."""

    def on_unit_start(self, unit: Unit) -> None:
        """The unit's inputs are in; its compute starts."""

    def on_action_end(self, action: Action) -> None:
        """``action`` ran and its result was handed on (padding actions too: they run as nothing)."""

    def on_unit_end(self, unit: Unit) -> None:
        """Every action of the unit ended (after their :meth:`on_action_end`)."""

    def on_op(self, op) -> None:
        """Issue an op of the rank's program the runner does not run itself (``schedule.lowering.DELEGATED``)."""

    def on_run_end(self) -> None:
        """The schedule ran to its end (not called when the run raised)."""

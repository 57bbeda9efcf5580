"""What the runner tells the code that watches a rank's schedule run.

Anything that must happen at a point of the schedule but is not part of running it (recording a
timeline, starting a chunk's gradient reduction where the program says) is a
:class:`RunListener` handed to ``run_rank``: the runner calls its hooks in schedule order and
knows nothing else about it. ``unit`` is one execution unit: indices into the rank's actions
(one action, or an overlapped F with the backward after it; see ``schedule.actions.units``).

The hooks run once per unit per rank (the hot path): keep them cheap. Standard library only.
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
        """An op of the rank's lowered program that the runner does not run itself
        (``schedule.lowering.DELEGATED``: a parameter gather or its wait, a bd sum or its wait, a
        data-parallel reduction, the loss gather, a finalize collective): issue it here."""

    def on_run_end(self) -> None:
        """The schedule ran to its end: every send completed, no tensor left over. Not called
        when the run raised."""

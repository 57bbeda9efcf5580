"""Schedules as data: pure, standard-library-only generators, dependency rule and simulator."""
from .actions import B, BW, F, W, Action, format_grid
from .generators import SCHEDULES, Schedule, ScheduleError, build_schedule, validate
from .layout import Layout

__all__ = ["Action", "F", "B", "BW", "W", "format_grid", "SCHEDULES", "Schedule", "ScheduleError",
           "build_schedule", "validate", "Layout"]

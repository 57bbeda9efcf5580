"""Schedules as data: pure, standard-library-only registry, generators, dependency rule and simulator."""
from .actions import B, BW, F, W, Action, format_grid
from .layout import Layout
from .registry import NAMES as SCHEDULES
from .registry import Schedule, ScheduleError, ScheduleSpec, build_schedule, get, validate

__all__ = ["Action", "F", "B", "BW", "W", "format_grid", "SCHEDULES", "Schedule", "ScheduleError", "ScheduleSpec",
           "build_schedule", "get", "validate", "Layout"]

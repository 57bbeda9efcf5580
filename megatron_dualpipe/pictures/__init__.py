"""Drawings: simulated schedules, measured timelines, figure layout."""

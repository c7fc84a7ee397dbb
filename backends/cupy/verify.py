"""Dtype-aware comparison against the numpy reference, for the remote runner.

A re-export of :mod:`planner.core.tolerance`, which imports numpy only, so the runner
still needs no egglog and no planner module that imports it.
"""

from __future__ import annotations

from planner.core.tolerance import allclose_report, tolerance

__all__ = ["allclose_report", "tolerance"]

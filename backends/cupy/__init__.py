"""Deprecated alias of ``fusion_planner.backends.cupy`` (removed in release 0.3)."""

from fusion_planner.backends.cupy import CupyBackend

__all__ = ["CupyBackend"]

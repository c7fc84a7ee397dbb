"""Dtype-aware comparison against the numpy reference.

Same names as the planned ``planner/tolerance.py`` (helper "rules"); kept here
in one place so the remote runner has no other planner dependency.  When that
module lands, these two functions should become a re-export of it.
"""

from __future__ import annotations

import numpy as np

#: (rtol, atol) per storage dtype; fp32 is the seed's 1e-4 * (|expected| + 1)
TOLERANCES: dict[str, tuple[float, float]] = {"fp32": (1e-4, 1e-4), "fp16": (1e-2, 1e-2), "bf16": (4e-2, 4e-2)}


def tolerance(dtype: str) -> tuple[float, float]:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype!r}") from None


def allclose_report(actual: np.ndarray, expected: np.ndarray, dtype: str) -> tuple[bool, float, float]:
    """(ok, max_abs, max_rel): ok iff |a - e| <= atol + rtol*|e| everywhere (NaN fails)."""
    rtol, atol = tolerance(dtype)
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return False, float("inf"), float("inf")
    diff = np.abs(a - e)
    ok = bool(np.all(diff <= atol + rtol * np.abs(e)))  # False on any NaN
    max_abs = float(np.nanmax(diff)) if diff.size else 0.0
    max_rel = float(np.nanmax(diff / (np.abs(e) + atol))) if diff.size else 0.0
    return ok, max_abs, max_rel

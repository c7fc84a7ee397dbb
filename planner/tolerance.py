"""Tolerances for comparing a candidate's outputs with the reference.

One place for every comparison in the project: ``tolerance(dtype)`` gives the
(rtol, atol) of a storage dtype and ``allclose_report`` applies it.  A value is
close when ``|a - e| <= atol + rtol * |e|``; NaN must meet NaN and an infinity
the same infinity, so a kernel that produces NaN/Inf where the reference does
not always fails.
"""

from __future__ import annotations

import numpy as np

#: storage dtype -> (rtol, atol); fused kernels skip intermediate roundings, so a
#: few ulps of the storage type separate fused from unfused results
TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-4),
    "fp16": (1e-2, 1e-2),
    "bf16": (5e-2, 5e-2),
}


def tolerance(dtype: str) -> tuple[float, float]:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(TOLERANCES)}") from None


def allclose_report(
    actual: np.ndarray,
    expected: np.ndarray,
    dtype: str,
    rtol: float | None = None,
    atol: float | None = None,
) -> tuple[bool, float, float]:
    """(ok, max_abs, max_rel) of ``actual`` against ``expected``; overrides replace the dtype's tolerance.

    max_abs/max_rel are taken over the finite positions; a NaN/Inf mismatch or a
    shape mismatch makes ok False (and max_abs infinite).
    """
    d_rtol, d_atol = tolerance(dtype)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return False, float("inf"), float("inf")
    a_fin, e_fin = np.isfinite(a), np.isfinite(e)
    same_special = np.array_equal(np.isnan(a), np.isnan(e)) and np.array_equal(
        np.where(np.isinf(a), a, 0.0), np.where(np.isinf(e), e, 0.0)
    )
    both = a_fin & e_fin
    if not both.any():
        return bool(same_special), 0.0, 0.0
    diff = np.abs(a[both] - e[both])
    mag = np.abs(e[both])
    max_abs = float(diff.max())
    max_rel = float((diff / np.maximum(mag, max(atol, np.finfo(np.float64).tiny))).max())
    ok = bool(same_special and np.all(diff <= atol + rtol * mag))
    if not same_special:
        max_abs = float("inf")
    return ok, max_abs, max_rel

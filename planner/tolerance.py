"""Dtype-aware tolerances: when two results of the same computation agree.

Fused and unfused plans round at different places (a fused kernel keeps
intermediates in fp32 registers, an unfused one stores them in the tensor's
dtype), and backends sum GEMMs in different orders.  Their results therefore
differ by a few units in the last place (ulp) of the storage dtype, scaled by
the magnitudes involved.  ``docs/rules.md`` explains the numbers.

An element passes when ``|actual - expected| <= atol * scale + rtol * |expected|``
where ``scale`` is at least 1 and defaults to the largest finite ``|expected|``:
a rounding error is relative to the values that were rounded, so an element
that came out near zero through cancellation is judged against the tensor's
magnitude, not its own.  Non-finite values must match exactly (NaN where NaN,
the same infinity where an infinity).
"""

from __future__ import annotations

import numpy as np

#: (rtol, atol) per dtype; "fp64" is the oracle's exact-arithmetic check
TOLERANCES: dict[str, tuple[float, float]] = {
    # fp32 registers everywhere: only summation order and FMA differ between backends
    "fp32": (1e-4, 1e-5),
    # 2^-11 unit roundoff: about 10 ulp relative, 2 ulp of the tensor's magnitude absolute
    "fp16": (1e-2, 2e-3),
    # 2^-8 unit roundoff: about 6 ulp relative, 2.5 ulp of the tensor's magnitude absolute
    "bf16": (5e-2, 2e-2),
    # mathematical equality up to fp64 reassociation noise
    "fp64": (1e-9, 1e-9),
}


def tolerance(dtype: str) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing results stored as ``dtype``."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}") from None


def allclose_report(
    actual: np.ndarray,
    expected: np.ndarray,
    dtype: str,
    *,
    scale: float | None = None,
    extra_atol: float = 0.0,
    extra_rtol: float = 0.0,
) -> tuple[bool, float, float]:
    """``(ok, max_abs, max_rel)`` of ``actual`` against ``expected``.

    ``scale`` (default: the largest finite ``|expected|``, at least 1) multiplies
    ``atol``.  ``extra_atol``/``extra_rtol`` widen the bound by a documented
    approximation (absolute, not scaled).  ``max_rel`` divides by
    ``max(|expected|, atol * scale)`` so that elements near zero do not report
    an infinite relative error.  A NaN/Inf mismatch gives ``(False, inf, inf)``.
    """
    rtol, atol = tolerance(dtype)
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return False, float("inf"), float("inf")
    fa, fe = np.isfinite(a), np.isfinite(e)
    same_special = np.where(np.isnan(e), np.isnan(a), a == e)
    if not np.array_equal(fa, fe) or not np.all(same_special[~fe]):
        return False, float("inf"), float("inf")
    if not fe.any():
        return True, 0.0, 0.0
    af, ef = a[fe], e[fe]
    if scale is None:
        scale = float(np.max(np.abs(ef)))
    scale = max(1.0, float(scale))
    diff = np.abs(af - ef)
    floor = atol * scale
    bound = floor + extra_atol + (rtol + extra_rtol) * np.abs(ef)
    max_abs = float(diff.max())
    max_rel = float((diff / np.maximum(np.abs(ef), floor)).max())
    return bool(np.all(diff <= bound)), max_abs, max_rel

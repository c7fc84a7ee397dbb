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

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from planner.core.dtypes import DTYPES
from planner.core.errors import UsageError
from planner.core.plans import Load, Plan

#: (rtol, atol) per storage dtype (planner.core.dtypes), and "fp64", the oracle's exact-arithmetic check:
#: mathematical equality up to fp64 reassociation noise
TOLERANCES: dict[str, tuple[float, float]] = {**{d.name: (d.rtol, d.atol) for d in DTYPES.values()},
                                               "fp64": (1e-9, 1e-9)}


#: the loosest relative or absolute tolerance a caller may ask for: past it, a check passes whatever a
#: candidate computes (``--rtol 1e30`` "verified" every candidate)
MAX_TOLERANCE = 0.25


def check_tolerance_override(rtol: float | None, atol: float | None) -> None:
    """Refuse a tolerance override that is not a finite number in [0, MAX_TOLERANCE]."""
    for name, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and not (math.isfinite(v) and 0 <= v <= MAX_TOLERANCE):
            raise UsageError(f"{name} must be a number from 0 to {MAX_TOLERANCE} (a looser check could not fail), "
                             f"got {v}")


def vacuous_inputs(inputs: Mapping[str, np.ndarray]) -> str | None:
    """Why a check on these inputs could not fail, or None: an input NaN or infinite everywhere (every
    comparison is NaN against NaN), or every input of more than one element constant (all zeros: GELU(0) =
    ReLU(0) = 0 for every candidate)."""
    arrays = {name: _values(x) for name, x in inputs.items()}
    for name, a in arrays.items():
        if a.size and not np.isfinite(a).any():
            return f"input {name!r} is NaN or infinite everywhere: every comparison would pass or fail alike"
    varied = [a for a in arrays.values() if a.size > 1]
    if varied and all(a.min() == a.max() for a in varied):
        return ("every input is constant (all of one value, such as zeros): different computations agree on "
                "it, so the check could not tell them apart")
    return None


def _values(x: np.ndarray) -> np.ndarray:
    """An input's values as numbers numpy compares (a 16-bit array of ml_dtypes' bf16 as fp32)."""
    a = np.asarray(x)
    return a if a.dtype.kind in "fiu" else a.astype(np.float32)


def vacuous_reference(names: Sequence[str], expected: Sequence[np.ndarray]) -> str | None:
    """Why a check against these reference outputs could not fail, or None: an output NaN or infinite
    everywhere."""
    for name, want in zip(names, expected, strict=True):
        w = np.asarray(want)
        if w.size and not np.isfinite(w).any():
            return f"the reference output {name!r} is NaN or infinite everywhere on these inputs"
    return None


def verification_text(plan: Plan, rtol: float | None, atol: float | None, inputs: str) -> str:
    """What the output check of ``plan``'s candidates compares, in one line: each output, its shape and the
    tolerance it is judged by, against the reference executor on ``inputs``."""
    outs = ", ".join(f"{o} {list(plan.tensors[o].shape)} ({_tol_text(working_dtype(plan, o), rtol, atol)})"
                     for o in plan.outputs)
    return f"every output against the numpy reference on {inputs}: {outs}"


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
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape:
        return False, float("inf"), float("inf")
    fe = np.isfinite(e)
    if fe.all():  # the common case: no masks, no copies of the finite elements
        if not np.isfinite(a).all():
            return False, float("inf"), float("inf")
        af, ef = a.ravel(), e.ravel()
    else:
        fa = np.isfinite(a)
        same_special = np.where(np.isnan(e), np.isnan(a), a == e)
        if not np.array_equal(fa, fe) or not np.all(same_special[~fe]):
            return False, float("inf"), float("inf")
        af, ef = a[fe], e[fe]
    if af.size == 0:
        return True, 0.0, 0.0
    if scale is None:
        scale = float(np.max(np.abs(ef)))
    floor = atol * max(1.0, float(scale))
    ok, max_abs, max_rel = True, 0.0, 0.0
    for start in range(0, af.size, _CHUNK):  # in float64, a cache-sized chunk at a time
        ac = af[start:start + _CHUNK].astype(np.float64)
        ec = ef[start:start + _CHUNK].astype(np.float64)
        diff = np.abs(ac - ec)
        abs_e = np.abs(ec)
        ok = ok and bool(np.all(diff <= floor + extra_atol + (rtol + extra_rtol) * abs_e))
        max_abs = max(max_abs, float(diff.max()))
        max_rel = max(max_rel, float((diff / np.maximum(abs_e, floor)).max()))
    return ok, max_abs, max_rel


#: elements per chunk of the tolerance check (a few hundred KiB of float64 temporaries)
_CHUNK = 1 << 15


# ---------------------------------------------------------------- the output check
# One check for the search, `run`, the composite check of a layer stack, the remote runner and the
# pipeline property test.


def working_dtype(plan: Plan, name: str) -> str:
    """The least precise dtype the value of tensor ``name`` was computed through: its own, or that of any op
    before it (an fp16 sum cast to fp32 carries the fp16 rounding, which fused and unfused plans do at
    different places). Its tolerance is the one the tensor is judged by."""
    writers = {k.out: k for k in plan.kernels}
    dtypes, seen, todo = {plan.tensors[name].dtype}, set(), [name]
    while todo:
        t = todo.pop()
        if t in seen or t not in writers:
            continue
        seen.add(t)
        for e in writers[t].body.walk():
            dtypes.add(e.type.dtype)
            todo += [a.tensor for a in e.args if isinstance(a, Load)]
    return least_precise(dtypes)


def least_precise(dtypes: Iterable[str]) -> str:
    """Of ``dtypes``, the one with the loosest tolerance (bf16 over fp16 over fp32)."""
    return max(sorted(dtypes), key=lambda d: tolerance(d)[0])


def check_outputs(
    plan: Plan,
    outs: Sequence[np.ndarray],
    expected: Sequence[np.ndarray],
    rtol: float | None = None,
    atol: float | None = None,
    oracle: Sequence[np.ndarray] | None = None,
    finite_inputs: bool = True,
) -> tuple[str | None, float, float]:
    """(reason the outputs are wrong or None, worst max_abs, worst max_rel) against the reference.

    A reference that is NaN or infinite on finite inputs (``finite_inputs``, as the input recipe
    always is) proves nothing: the graph overflows or is undefined in its dtype there, and a
    candidate matching it would be "verified" vacuously. The check fails with that reason.

    With ``oracle`` (the graph's fp64 values) and no ``rtol``/``atol`` override, an output
    outside the tolerance is still accepted when it is no further from the oracle than
    twice the reference's own error:
    in a deep, ill-conditioned fp16 graph (a residual stream in the thousands, norms) the
    rounding a fusion moves grows far beyond any fixed tolerance (docs/rules.md).
    """
    if len(outs) != len(expected):
        return f"{len(outs)} outputs, expected {len(expected)}", float("inf"), float("inf")
    worst_abs = worst_rel = 0.0
    for i, (name, got, want) in enumerate(zip(plan.outputs, outs, expected, strict=True)):
        got = np.asarray(got)
        bad = int((~np.isfinite(want)).sum())
        if bad and finite_inputs:
            reason = (f"the reference output {name} has {bad} of {want.size} values NaN or infinite on finite inputs: "
                      f"the graph overflows or is undefined in {plan.tensors[name].dtype} here, so nothing can be verified")
            return reason, float("inf"), float("inf")
        if got.shape != want.shape:
            return f"output {name} has shape {list(got.shape)}, expected {list(want.shape)}", float("inf"), float("inf")
        if not np.array_equal(np.isfinite(got), np.isfinite(want)):
            n_got, n_want = int((~np.isfinite(got)).sum()), int((~np.isfinite(want)).sum())
            reason = f"NaN/Inf: output {name} has {n_got} non-finite values, the reference {n_want}"
            return reason, float("inf"), float("inf")
        dtype = working_dtype(plan, name)
        ok, max_abs, max_rel = allclose_with(got, want, dtype, rtol, atol)
        if not ok and oracle is not None and rtol is None and atol is None:
            ref_err = float(np.nanmax(np.abs(want.astype(np.float64) - oracle[i]), initial=0.0))
            ok = allclose_report(got, oracle[i], dtype, extra_atol=2 * ref_err)[0]
        worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, max_rel)
        if not ok:
            reason = f"tolerance: output {name} max_abs {max_abs:.3g} max_rel {max_rel:.3g} ({_tol_text(dtype, rtol, atol)})"
            return reason, worst_abs, worst_rel
    return None, worst_abs, worst_rel


def allclose_with(
    got: np.ndarray, want: np.ndarray, dtype: str, rtol: float | None, atol: float | None
) -> tuple[bool, float, float]:
    """``allclose_report`` with the dtype's tolerance, or with ``rtol``/``atol`` replacing it.

    A replacement is expressed through the extra terms: with ``scale=1`` the bound
    ``atol_d + extra_atol + (rtol_d + extra_rtol)|e|`` becomes exactly ``atol + rtol|e|``.
    """
    d_rtol, d_atol = tolerance(dtype)
    if rtol is None and atol is None:
        return allclose_report(got, want, dtype)
    kw: dict[str, float] = {}
    if rtol is not None:
        kw["extra_rtol"] = rtol - d_rtol
    if atol is not None:
        kw.update(scale=1.0, extra_atol=atol - d_atol)
    return allclose_report(got, want, dtype, **kw)


def _tol_text(dtype: str, rtol: float | None, atol: float | None) -> str:
    d_rtol, d_atol = tolerance(dtype)
    a = f"atol {atol:g}" if atol is not None else f"atol {d_atol:g} x max|ref|"
    return f"rtol {d_rtol if rtol is None else rtol:g}, {a}, {dtype}"

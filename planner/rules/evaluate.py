"""Checking one instantiation of a rule: both sides evaluated through the op table at the exact and the device
level (:class:`Eval`), and a case drawn for its pattern variables (:func:`draw_case`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from planner.core.dtypes import DTYPES as STORAGE_DTYPES
from planner.core.dtypes import round_to
from planner.core.kinds import OpKind
from planner.core.ops import CUBLASLT_EPILOGUES, OPS
from planner.core.tolerance import allclose_report
from planner.rules.prepare import DIMS, DTYPES, MAGNITUDES, ZERO_FRACTIONS, Prepared, attrs_of, oplist, scalar_of
from planner.rules.terms import COMPARISONS, SCALAR_FNS, Approx, Call, Lit, Obligation, RuleSpec, Term, Var

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- evaluation


_NOBIAS = object()


@dataclass
class Eval:
    """Evaluates terms in one mode; records the magnitude of everything computed."""

    env: Mapping[Term, np.ndarray]
    scalars: Mapping[str, Any]
    dtype: str
    exact: bool
    scale: float = 0.0

    @property
    def work(self) -> type[np.floating]:
        return np.float64 if self.exact else np.float32

    def note(self, x: np.ndarray) -> np.ndarray:
        finite = np.abs(x[np.isfinite(x)])
        if finite.size:
            self.scale = max(self.scale, float(finite.max()))
        return x

    def store(self, x: np.ndarray) -> np.ndarray:
        return x if self.exact else round_to(x, self.dtype)

    def value(self, t: Term) -> Any:
        if t in self.env:
            return self.note(self.env[t].astype(self.work))
        if isinstance(t, Lit):
            return t.value
        if isinstance(t, Var):
            return self.scalars[t.name]
        if t.name in SCALAR_FNS:
            return SCALAR_FNS[t.name](*(self.value(a) for a in t.args))
        if t.name == "K":
            return self.note(self.store(self.value(t.args[0])))
        if t.name == "NoBias":
            return _NOBIAS
        if t.name == "CublasLt":
            a, b, bias = (self.value(x) for x in t.args[:3])
            out = self.apply("MatMul", [a, b], {})
            for op in CUBLASLT_EPILOGUES[str(t.args[3].value)]:  # type: ignore[union-attr]
                out = self.apply(op, [out, bias] if op == "BiasAdd" else [out], {})
            return self.note(self.store(out))
        if t.name == "Opaque":
            ins = [self.value(x) for x in oplist(t.args[2])]
            return self.apply("Opaque", ins, {"impl": t.args[0].value})  # type: ignore[union-attr]
        opdef = OPS[t.name]
        ins = [self.value(x) for x in t.args[: opdef.arity]]
        return self.apply(t.name, ins, attrs_of(t, self.scalars))

    def apply(self, name: str, ins: list[np.ndarray], attrs: Mapping[str, Any]) -> np.ndarray:
        with np.errstate(all="ignore"):
            out = np.asarray(OPS[name].evaluate(ins, attrs), dtype=self.work)
            if OPS[name].kind == OpKind.MATMUL:  # the magnitude the rounding errors of a dot product scale with
                self.note(np.abs(ins[0]) @ np.abs(ins[1]))
        return self.note(out)


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    dtype: str
    shapes: dict[Term, tuple[int, ...]]
    values: dict[Term, np.ndarray]  # float32 register values (stored leaves already rounded)
    scalars: dict[str, Any]
    magnitude: float
    zeros: float


class Failure(Exception):
    def __init__(self, detail: dict[str, Any]) -> None:
        super().__init__(detail.get("reason", "unsound"))
        self.detail = detail


def draw_case(data: Any, prep: Prepared) -> Case:

    k = data.draw(st.integers(0, len(prep.schemes) - 1), label="shape scheme")
    dims = [prep.fixed[k].get(i) or data.draw(st.sampled_from(DIMS), label=f"dim{i}") for i in range(prep.n_dims[k])]
    shapes = {lf: tuple(dims[i] for i in idx) for lf, idx in prep.schemes[k].items()}
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    magnitude = data.draw(st.sampled_from(MAGNITUDES), label="magnitude")
    zeros = data.draw(st.sampled_from(ZERO_FRACTIONS), label="zeros")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    scalars: dict[str, Any] = {}
    for name, sort in sorted(prep.sorts.items()):
        if sort == "f64":
            scalars[name] = data.draw(
                st.one_of(st.sampled_from([1.0, 0.0, -1.0]), st.floats(-8, 8, allow_nan=False, width=32)), label=name
            )
        elif sort == "i64":
            scalars[name] = data.draw(st.integers(0, 256), label=name)
        elif sort == "String":
            scalars[name] = data.draw(st.sampled_from(prep.choices[name]), label=name)
    rng = np.random.default_rng(seed)
    values = {}
    for lf, shape in shapes.items():
        x = rng.standard_normal(shape) * magnitude
        x[rng.random(shape) < zeros] = 0.0
        x = x.astype(np.float32)
        values[lf] = round_to(x, dtype) if lf in prep.stored else x
    return Case(dtype, shapes, values, scalars, magnitude, zeros)


def conditions_hold(prep: Prepared, case: Case) -> bool:
    for c in prep.conditions:
        if isinstance(c, Call) and c.name in COMPARISONS:
            a, b = (scalar_of(x, case.scalars) for x in c.args)
            if not COMPARISONS[c.name](a, b):
                return False
    return True


def check_case(rule: RuleSpec, prep: Prepared, case: Case) -> None:
    """Raise Failure when the case breaks an obligation."""
    approx = rule.approx or Approx(0.0)
    for o in prep.obligations:
        if o.kind != "eq":
            continue
        exact = Eval(case.values, case.scalars, case.dtype, exact=True)
        lhs, rhs = exact.value(o.lhs), exact.value(o.rhs)  # type: ignore[arg-type]
        ok, mabs, mrel = allclose_report(rhs, lhs, "fp64", scale=exact.scale, extra_atol=approx.abs, extra_rtol=approx.rel)
        if not ok:
            raise Failure(failure_detail(o, case, "exact (fp64, K = identity)", lhs, rhs, mabs, mrel))
        if exact.scale > max_finite(case.dtype) / 4:
            continue  # out of the dtype's range: stores overflow; only the exact check applies
        dev = Eval(case.values, case.scalars, case.dtype, exact=False)
        lhs, rhs = dev.value(o.lhs), dev.value(o.rhs)  # type: ignore[arg-type]
        ok, mabs, mrel = allclose_report(
            rhs, lhs, case.dtype, scale=max(dev.scale, exact.scale), extra_atol=approx.abs, extra_rtol=approx.rel
        )
        if not ok:
            raise Failure(failure_detail(o, case, f"device (fp32 registers, stores in {case.dtype})", lhs, rhs, mabs, mrel))


def max_finite(dtype: str) -> float:
    return STORAGE_DTYPES[dtype].max_finite


def fmt_value(x: Any, limit: int = 8) -> str:
    a = np.asarray(x, dtype=np.float64).ravel()
    body = ", ".join(f"{v:.6g}" for v in a[:limit])
    return f"[{body}{', …' if a.size > limit else ''}]"


def failure_detail(o: Obligation, case: Case, level: str, lhs: Any, rhs: Any, mabs: float, mrel: float) -> dict[str, Any]:
    lhs64, rhs64 = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    diff = np.abs(np.nan_to_num(lhs64 - rhs64, nan=np.inf))
    where = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else ()
    return {
        "level": level,
        "dtype": case.dtype,
        "magnitude": case.magnitude,
        "zero_fraction": case.zeros,
        "shapes": {str(k): list(v) for k, v in case.shapes.items()},
        "inputs": {str(k): np.asarray(v, np.float64).tolist() for k, v in case.values.items()},
        "scalars": dict(case.scalars),
        "max_abs": mabs,
        "max_rel": mrel,
        "worst_index": [int(i) for i in where],
        "lhs_at": float(lhs64[where]) if diff.size else None,
        "rhs_at": float(rhs64[where]) if diff.size else None,
        "lhs": str(o.lhs),
        "rhs": str(o.rhs),
    }



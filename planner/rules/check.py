"""Rule soundness: every rewrite must leave what the graph computes unchanged.

Each rule of a rule file is parsed with egglog's own parser and turned into
*obligations*: ``lhs == rhs`` for a rewrite, birewrite or ``union`` action, and
structural facts for ``(Mem t)``/``(Ew t)`` actions.  The pattern variables are
instantiated with random tensors whose shapes are *derived from the op table's
shape rules* (run on symbolic dimensions that unify when compared), so any
rule over op-table constructors is checkable, users' rules included.

Both sides are evaluated through the op table at two levels:

* ``exact``: fp64, ``K`` is the identity; the sides must agree to fp64
  reassociation noise.  This catches every mathematical mistake.
* ``device``: fp32 registers, ``K`` rounds to the tensor's dtype (a store),
  ``CublasLt`` is its epilogue's op tree in fp32 followed by a store; the sides
  must agree within :func:`planner.core.tolerance.tolerance` of the dtype.  This is
  the rounding a fused kernel legitimately changes.

The tolerance's absolute term is scaled by the largest magnitude among the
values the two sides compute (for ``MatMul`` the sum of absolute products), as
a store's rounding error is relative to the stored value.  Conditions
``(Mem x)``/``(Ew x)`` are structural facts that hold for the instantiated
values: a ``Mem`` variable is drawn already rounded to its dtype (it was read
from memory), an ``Ew`` variable is any fp32 register value.  A rule whose
sides differ by a known approximation says so in the comment directly above
it, ``; approx: abs 5e-4 [rel R]``, and is checked against that bound.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, assume, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from hypothesis.reporting import with_reporter

from planner.core.dtypes import DTYPES as STORAGE_DTYPES
from planner.core.dtypes import round_to
from planner.core.kinds import OpKind
from planner.core.ops import CUBLASLT_EPILOGUES, OPS, OpError, epilogue_has_bias
from planner.core.tolerance import allclose_report
from planner.rules.files import RuleFileError, parse_rule_forms, read_rule_file, shipped_rules

log = logging.getLogger(__name__)

DTYPES = tuple(STORAGE_DTYPES)
#: dimension sizes drawn for each shape variable: 1, odd sizes, non-multiples of 8 (shrinks to 1)
DIMS = (1, 2, 3, 5, 7, 8, 13, 17)
#: value magnitudes drawn for tensors: unit, tiny, large
MAGNITUDES = (1.0, 1e-3, 30.0, 1e3)
ZERO_FRACTIONS = (0.0, 0.3, 1.0)
MAX_RANK = 3
DEFAULT_EXAMPLES = 100


class UnsoundRuleError(RuleFileError):
    """A user rule file holds a rule the checker does not find sound."""


# ---------------------------------------------------------------- terms


@dataclass(frozen=True)
class Var:
    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Lit:
    value: Any

    def __str__(self) -> str:
        return f'"{self.value}"' if isinstance(self.value, str) else repr(self.value)


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple[Term, ...]

    def __str__(self) -> str:
        return f"({' '.join([self.name, *map(str, self.args)])})"


Term = Var | Lit | Call

#: the rule language beyond the op table: name -> argument sorts
STRUCTURAL: dict[str, tuple[str, ...]] = {
    "K": ("Op",),
    "In": ("String",),
    "NoBias": (),
    "CublasLt": ("Op", "Op", "Op", "String"),
    "Opaque": ("String", "String", "OpList"),
    "Cons": ("Op", "OpList"),
    "Nil": (),
}
RELATIONS = ("Mem", "Ew", "Forced")
SCALAR_FNS: dict[str, Callable[..., Any]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b if b else (math.copysign(math.inf, a) if a else math.nan),  # as f64 divides in egglog
    "min": min,
    "max": max,
    "neg": lambda a: -a,
    "abs": abs,
}
COMPARISONS: dict[str, Callable[[Any, Any], bool]] = {
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b,
    ">=": lambda a, b: a >= b,
    "!=": lambda a, b: a != b,
}


def arg_sorts(name: str) -> tuple[str, ...] | None:
    """Argument sorts of a constructor, from the op table (None: unknown)."""
    if name in STRUCTURAL:
        return STRUCTURAL[name]
    op = OPS.get(name)
    if op is None or op.kind in (OpKind.INPUT, OpKind.OPAQUE):
        return None
    return ("Op",) * (op.arity or 0) + tuple(a.sort for a in op.attrs)


def _term(e: Any) -> Term:
    kind = type(e).__name__
    if kind == "Var":
        return Var(e.name)
    if kind == "Lit":
        return Lit(getattr(e.value, "value", None))
    if kind == "Call":
        return Call(e.name, tuple(_term(a) for a in e.args))
    raise _Unsupported(f"expression {e!r}")


# ---------------------------------------------------------------- rules


@dataclass(frozen=True)
class Approx:
    """A documented approximation: |lhs - rhs| <= abs + rel*|lhs| on top of the tolerance."""

    abs: float
    rel: float = 0.0


@dataclass(frozen=True)
class Obligation:
    kind: str  # "eq" | "Mem" | "Ew"
    lhs: Term
    rhs: Term | None = None


@dataclass(frozen=True)
class RuleSpec:
    """One rule of a rule file, as the checker sees it."""

    path: str
    line: int
    text: str
    kind: str  # rewrite | birewrite | rule
    comment: str
    bindings: tuple[tuple[str, Term], ...]
    conditions: tuple[Term, ...]
    obligations: tuple[Obligation, ...]
    creates: tuple[Term, ...] = ()
    approx: Approx | None = None
    problem: str | None = None  # set when the rule cannot be read (unsupported form)

    @property
    def label(self) -> str:
        return f"{self.path}:{self.line}"


class _Unsupported(Exception):
    pass


_APPROX_RE = re.compile(r"approx\w*\s*:\s*abs\s*=?\s*([0-9.eE+-]+)(?:[\s,;]+rel\s*=?\s*([0-9.eE+-]+))?")


def rules_of(path: str, text: str, *, shipped: bool) -> list[RuleSpec]:
    """Parse a rule file with egglog's parser (refusing forbidden commands) into rules."""
    lines = text.splitlines()
    out = []
    for line, cmd in parse_rule_forms(text, path, shipped=shipped):
        kind = type(cmd).__name__
        if kind not in ("RewriteCommand", "BiRewriteCommand", "RuleCommand"):
            continue
        node = cmd.rule if kind == "RuleCommand" else cmd.rewrite
        comment = _comment_above(lines, line)
        m = _APPROX_RE.search(comment)
        approx = Approx(float(m.group(1)), float(m.group(2) or 0.0)) if m else None
        text_1 = re.sub(r"\s+\)", ")", " ".join(str(cmd).split()))
        base: dict[str, Any] = {"path": path, "line": line, "text": text_1, "comment": comment, "approx": approx}
        try:
            if not shipped:
                _refuse_removals(cmd, kind)
            if kind == "RuleCommand":
                out.append(_from_rule(node, base))
            else:
                out.append(_from_rewrite(node, "rewrite" if kind == "RewriteCommand" else "birewrite", base))
        except _Unsupported as exc:
            short = {"RewriteCommand": "rewrite", "BiRewriteCommand": "birewrite"}.get(kind, "rule")
            out.append(RuleSpec(kind=short, bindings=(), conditions=(), obligations=(), problem=str(exc), **base))
    return out


def _refuse_removals(cmd: Any, kind: str) -> None:
    """What a user rule may not do, however sound: remove a form (``delete``, ``subsume``: it may be the
    unfused form every plan falls back on, or a graph input), or fire with no query (its terms are not the
    graph's)."""
    if kind == "RuleCommand":
        if not cmd.rule.body:
            raise _Unsupported("a rule with no query: it adds terms that are not the graph's (a user rule "
                               "must match something)")
        if any(type(a).__name__ == "Change" for a in cmd.rule.head):
            raise _Unsupported("delete or subsume in a user rule: removing a form can remove the unfused "
                               "form every plan falls back on, or a graph input (user rules may only add)")
    elif getattr(cmd, "subsume", False):
        raise _Unsupported(":subsume in a user rewrite: it removes the matched form, which can be the unfused "
                           "form every plan falls back on (user rules may only add)")


def _comment_above(lines: Sequence[str], line: int) -> str:
    got: list[str] = []
    i = line - 2
    while i >= 0 and lines[i].lstrip().startswith(";"):
        got.append(lines[i].lstrip().lstrip(";").strip())
        i -= 1
    return " ".join(reversed(got))


def _facts(facts: Iterable[Any]) -> tuple[list[tuple[str, Term]], list[Term]]:
    binds: list[tuple[str, Term]] = []
    conds: list[Term] = []
    for f in facts:
        if type(f).__name__ == "Eq":
            left, right = _term(f.left), _term(f.right)
            if isinstance(left, Var):
                binds.append((left.name, right))
            elif isinstance(right, Var):
                binds.append((right.name, left))
            else:
                raise _Unsupported(f"equality between two patterns {left} = {right}")
        else:
            conds.append(_term(f.expr))
    return binds, conds


def _from_rewrite(rw: Any, kind: str, base: dict[str, Any]) -> RuleSpec:
    binds, conds = _facts(rw.conditions)
    ob = Obligation("eq", _term(rw.lhs), _term(rw.rhs))
    return RuleSpec(kind=kind, bindings=tuple(binds), conditions=tuple(conds), obligations=(ob,), **base)


def _from_rule(rule: Any, base: dict[str, Any]) -> RuleSpec:
    binds, conds = _facts(rule.body)
    obs: list[Obligation] = []
    creates: list[Term] = []
    for act in rule.head:
        kind = type(act).__name__
        if kind == "Union":
            obs.append(Obligation("eq", _term(act.lhs), _term(act.rhs)))
        elif kind == "Let":
            binds.append((act.lhs, _term(act.rhs)))
        elif kind == "Expr_":
            t = _term(act.expr)
            if isinstance(t, Call) and t.name in RELATIONS:
                obs.append(Obligation(t.name, t.args[0]))
            else:
                creates.append(t)
        elif kind == "Change":
            pass  # subsume/delete only removes an alternative: it adds no equality, so no value changes
        else:
            raise _Unsupported(f"action {kind} (rule actions may be union, let, terms, subsume and Mem/Ew/Forced facts)")
    return RuleSpec(
        kind="rule",
        bindings=tuple(binds),
        conditions=tuple(conds),
        obligations=tuple(obs),
        creates=tuple(creates),
        **base,
    )


# ---------------------------------------------------------------- results


@dataclass
class RuleResult:
    rule: RuleSpec
    verdict: str  # sound | UNSOUND | unsupported | invalid
    cases: int = 0
    detail: str = ""
    counterexample: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.verdict == "sound"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "file": self.rule.path,
            "line": self.rule.line,
            "rule": self.rule.text,
            "verdict": self.verdict,
            "cases": self.cases,
        }
        if self.rule.approx is not None:
            d["approx"] = {"abs": self.rule.approx.abs, "rel": self.rule.approx.rel}
        if self.detail:
            d["detail"] = self.detail
        if self.counterexample is not None:
            d["counterexample"] = self.counterexample
        return d


# ---------------------------------------------------------------- preparing a rule


@dataclass
class _Prepared:
    """A rule with bindings substituted, sorts and shape schemes known."""

    obligations: list[Obligation]
    conditions: list[Term]
    creates: list[Term]
    sorts: dict[str, str]  # variable -> sort
    leaves: list[Term]  # tensor leaves: Op variables and In terms
    stored: set[Term]  # leaves whose values live in memory
    schemes: list[dict[Term, tuple[int, ...]]] = field(default_factory=list)
    n_dims: list[int] = field(default_factory=list)
    fixed: list[dict[int, int]] = field(default_factory=list)  # per scheme: dimension index -> its fixed size
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)  # String variable -> the values it takes


def _substitute(t: Term, binds: Mapping[str, Term], depth: int = 0) -> Term:
    if depth > 64:
        raise _Unsupported("cyclic variable bindings")
    if isinstance(t, Var) and t.name in binds:
        return _substitute(binds[t.name], binds, depth + 1)
    if isinstance(t, Call):
        return Call(t.name, tuple(_substitute(a, binds, depth + 1) for a in t.args))
    return t


def _infer_sorts(t: Term, sorts: dict[str, str], want: str) -> None:
    """Infer variable sorts; raise _Unsupported for unknown constructors, ValueError if ill-typed."""
    if isinstance(t, Var):
        if want == "scalar":  # a primitive's argument: any number sort, f64 unless known
            known = sorts.get(t.name)
            want = known if known is not None and known in ("f64", "i64") else "f64"
        if sorts.setdefault(t.name, want) != want:
            raise ValueError(f"variable {t.name} is used both as {sorts[t.name]} and {want}")
        return
    if isinstance(t, Lit):
        got = {bool: "bool", int: "i64", float: "f64", str: "String"}.get(type(t.value), "unit")
        if got != want and not (want == "scalar" and got in ("i64", "f64")):
            raise ValueError(f"literal {t} where a {want} is expected")
        return
    if t.name in SCALAR_FNS or t.name in COMPARISONS:
        if want not in ("f64", "i64", "scalar", "bool"):
            raise ValueError(f"primitive {t.name} where a {want} is expected")
        for a in t.args:
            _infer_sorts(a, sorts, want if want in ("f64", "i64") else "scalar")
        return
    if t.name in RELATIONS:
        if len(t.args) != 1:
            raise ValueError(f"{t.name} takes one argument")
        _infer_sorts(t.args[0], sorts, "Op")
        return
    want_args = arg_sorts(t.name)
    if want_args is None:
        raise _Unsupported(f"unknown constructor {t.name!r} (not in the op table or the rule language)")
    if len(t.args) != len(want_args):
        raise ValueError(f"{t.name} takes {len(want_args)} argument(s), got {len(t.args)}")
    if t.name == "CublasLt" and not (isinstance(t.args[3], Lit) and t.args[3].value in CUBLASLT_EPILOGUES):
        raise _Unsupported(
            f"CublasLt epilogue {t.args[3]} (must be a literal of {', '.join(CUBLASLT_EPILOGUES)})"
        )
    if t.name == "Opaque" and not isinstance(t.args[0], Lit):
        raise _Unsupported("Opaque with a variable implementation name")
    for a, s in zip(t.args, want_args, strict=True):
        if t.name in ("In", "Opaque") and s == "String" and isinstance(a, Var):
            continue  # names only: a tensor's identity, not a value
        _infer_sorts(a, sorts, s)


def _string_choices(t: Term, out: dict[str, tuple[str, ...]]) -> None:
    """The values each String variable may take: those of the op-table attribute it stands for (Cast's dtype)."""
    if not isinstance(t, Call):
        return
    op = OPS.get(t.name)
    if op is not None and op.kind not in (OpKind.INPUT, OpKind.OPAQUE):
        for spec, a in zip(op.attrs, t.args[op.arity or 0:], strict=False):
            if isinstance(a, Var) and spec.sort == "String" and spec.choices:
                out[a.name] = spec.choices
    for a in t.args:
        _string_choices(a, out)


def _leaves(t: Term, sorts: Mapping[str, str], out: dict[Term, None]) -> None:
    if isinstance(t, Var) and sorts.get(t.name) == "Op":
        out[t] = None
    elif isinstance(t, Call):
        if t.name == "In":
            out[t] = None
            return
        for a in t.args:
            _leaves(a, sorts, out)


def prepare(rule: RuleSpec) -> _Prepared:
    if rule.problem:
        raise _Unsupported(rule.problem)
    binds = dict(rule.bindings)
    obs = [
        Obligation(o.kind, _substitute(o.lhs, binds), None if o.rhs is None else _substitute(o.rhs, binds))
        for o in rule.obligations
    ]
    conds = [_substitute(c, binds) for c in rule.conditions]
    creates = [_substitute(c, binds) for c in rule.creates]
    sorts: dict[str, str] = {}
    for o in obs:
        for side in (o.lhs, o.rhs):
            if side is not None:
                _infer_sorts(side, sorts, "Op")
    for c in conds:
        _infer_sorts(c, sorts, "bool" if isinstance(c, Call) and c.name in COMPARISONS else "Op")
    for c in creates:
        _infer_sorts(c, sorts, "Op")
    leaves: dict[Term, None] = {}
    for t in [*(x for o in obs for x in (o.lhs, o.rhs) if x is not None), *conds, *creates]:
        _leaves(t, sorts, leaves)
    stored: set[Term] = {lf for lf in leaves if isinstance(lf, Call)}
    stored |= {c.args[0] for c in conds if isinstance(c, Call) and c.name == "Mem"}
    prep = _Prepared(obs, conds, creates, sorts, list(leaves), stored)
    for t in [*(x for o in obs for x in (o.lhs, o.rhs) if x is not None), *creates]:
        _string_choices(t, prep.choices)
    unknown = sorted(v for v, sort in sorts.items() if sort == "String" and v not in prep.choices)
    if unknown:
        raise _Unsupported(f"String variable {unknown[0]} of no attribute with listed values")
    _solve_shapes(prep)
    return prep


# ---------------------------------------------------------------- shapes


class _Dim:
    """A symbolic dimension: comparing two unifies them (the rule must type-check); comparing one with a
    number fixes it to that size (a reduction's kept dimension is 1)."""

    __slots__ = ("parent", "n", "size")

    def __init__(self, n: int) -> None:
        self.parent: _Dim = self
        self.n = n
        self.size: int | None = None

    def find(self) -> _Dim:
        while self.parent is not self:
            self.parent = self.parent.parent
            self = self.parent  # noqa: PLW0642
        return self

    def __eq__(self, other: object) -> bool:
        a = self.find()
        if isinstance(other, int) and not isinstance(other, bool):
            if a.size is None:
                a.size = other
            return a.size == other
        if not isinstance(other, _Dim):
            raise TypeError(f"symbolic dimension compared with {other!r}")
        b = other.find()
        if a is not b:
            if a.size is not None and b.size is not None and a.size != b.size:
                return False
            b.parent = a
            a.size = a.size if a.size is not None else b.size
        return True

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"d{self.find().n}"


def _shape(t: Term, env: Mapping[Term, Any], scalars: Mapping[str, Any]) -> Any:
    """Output shape of a tensor term (shapes may be symbolic); OpError if ill-typed."""
    if t in env:
        return env[t]
    assert isinstance(t, Call), t
    if t.name == "K":
        return _shape(t.args[0], env, scalars)
    if t.name == "NoBias":
        return None
    if t.name == "CublasLt":
        a, b, bias = (_shape(x, env, scalars) for x in t.args[:3])
        epi = str(t.args[3].value)  # type: ignore[union-attr]
        if (bias is not None) != epilogue_has_bias(epi):
            raise OpError(f"CublasLt {epi}: bias {'missing' if bias is None else 'given'}")
        out = OPS["MatMul"].out_shape([a, b], {})
        for op in CUBLASLT_EPILOGUES[epi]:
            out = OPS[op].out_shape([out, bias] if op == "BiasAdd" else [out], {})
        return out
    if t.name == "Opaque":
        ins = [_shape(x, env, scalars) for x in _oplist(t.args[2])]
        impl = str(t.args[0].value)  # type: ignore[union-attr]
        symbolic = any(isinstance(d, _Dim) for s in ins for d in s)
        if symbolic and impl in SHAPE_OVERRIDES:
            return SHAPE_OVERRIDES[impl](ins)
        return OPS["Opaque"].out_shape(ins, {"impl": impl})
    opdef = OPS[t.name]
    ins = [_shape(x, env, scalars) for x in t.args[: opdef.arity]]
    if any(s is None for s in ins):
        raise OpError(f"{t.name}: NoBias is only a CublasLt bias")
    return opdef.out_shape(ins, _attrs(t, scalars))


def _oplist(t: Term) -> list[Term]:
    out = []
    while isinstance(t, Call) and t.name == "Cons":
        out.append(t.args[0])
        t = t.args[1]
    if not (isinstance(t, Call) and t.name == "Nil"):
        raise _Unsupported(f"Opaque input list {t} (must be explicit Cons/Nil)")
    return out


def _tensor_terms(prep: _Prepared) -> list[Term]:
    out: list[Term] = []
    for o in prep.obligations:
        out += [x for x in (o.lhs, o.rhs) if x is not None]
    out += [c for c in prep.conditions if not (isinstance(c, Call) and (c.name in RELATIONS or c.name in COMPARISONS))]
    return out + prep.creates


def _attention_shape(shapes: Sequence[Any]) -> Any:
    q, k, v = shapes
    if len(q) != 2 or len(k) != 2 or len(v) != 2:
        raise OpError("attention takes 2-D q, k, v")
    _ = (k == v, q[1] == k[1])  # unify: k and v alike, one model dim (heads=1 in rules)
    return q


#: hand-written symbolic shape rules, only for registered Opaque implementations whose
#: shape rule does arithmetic on dimensions (the op table's own rules need none)
SHAPE_OVERRIDES: dict[str, Callable[[Sequence[Any]], Any]] = {"attention": _attention_shape}


class _AnyScalar(dict):
    """Attribute variables while deriving shapes: the op table's shape rules ignore their values."""

    def __missing__(self, key: str) -> int:
        return 1


def _solve_shapes(prep: _Prepared) -> None:
    """Every rank assignment under which the shape rules hold, with unified dims."""
    combos = sorted(itertools.product(range(1, MAX_RANK + 1), repeat=len(prep.leaves)), key=lambda r: (sum(r), r))
    for ranks in combos:
        counter = itertools.count()
        env = {lf: tuple(_Dim(next(counter)) for _ in range(r)) for lf, r in zip(prep.leaves, ranks, strict=True)}
        try:
            for o in prep.obligations:
                if o.kind == "eq":
                    left, right = _shape(o.lhs, env, _AnyScalar()), _shape(o.rhs, env, _AnyScalar())  # type: ignore[arg-type]
                    if left is None or right is None or len(left) != len(right):
                        raise OpError("sides differ in rank")
                    _ = left == right
            for t in _tensor_terms(prep):
                _shape(t, env, _AnyScalar())
        except (OpError, IndexError, ValueError):  # this rank assignment does not type-check
            continue
        except TypeError as exc:
            raise _Unsupported(f"a shape rule the checker cannot run symbolically ({exc})") from None
        roots: dict[int, int] = {}
        scheme = {
            lf: tuple(roots.setdefault(id(d.find()), len(roots)) for d in dims) for lf, dims in env.items()
        }
        prep.schemes.append(scheme)
        prep.n_dims.append(len(roots))
        prep.fixed.append({roots[id(d.find())]: size for dims in env.values() for d in dims
                           if (size := d.find().size) is not None})


# ---------------------------------------------------------------- evaluation


_NOBIAS = object()


@dataclass
class _Eval:
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
            ins = [self.value(x) for x in _oplist(t.args[2])]
            return self.apply("Opaque", ins, {"impl": t.args[0].value})  # type: ignore[union-attr]
        opdef = OPS[t.name]
        ins = [self.value(x) for x in t.args[: opdef.arity]]
        return self.apply(t.name, ins, _attrs(t, self.scalars))

    def apply(self, name: str, ins: list[np.ndarray], attrs: Mapping[str, Any]) -> np.ndarray:
        with np.errstate(all="ignore"):
            out = np.asarray(OPS[name].evaluate(ins, attrs), dtype=self.work)
            if OPS[name].kind == OpKind.MATMUL:  # the magnitude the rounding errors of a dot product scale with
                self.note(np.abs(ins[0]) @ np.abs(ins[1]))
        return self.note(out)


def _attrs(t: Call, scalars: Mapping[str, Any]) -> dict[str, Any]:
    op = OPS[t.name]
    vals = t.args[op.arity or 0 :]
    out = {}
    for spec, v in zip(op.attrs, vals, strict=True):
        out[spec.name] = _scalar(v, scalars)
    return out


def _scalar(t: Term, scalars: Mapping[str, Any]) -> Any:
    if isinstance(t, Lit):
        return t.value
    if isinstance(t, Var):
        return scalars[t.name]
    assert isinstance(t, Call)
    return SCALAR_FNS[t.name](*(_scalar(a, scalars) for a in t.args))


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    dtype: str
    shapes: dict[Term, tuple[int, ...]]
    values: dict[Term, np.ndarray]  # float32 register values (stored leaves already rounded)
    scalars: dict[str, Any]
    magnitude: float
    zeros: float


class _Failure(Exception):
    def __init__(self, detail: dict[str, Any]) -> None:
        super().__init__(detail.get("reason", "unsound"))
        self.detail = detail


def _draw_case(data: Any, prep: _Prepared) -> Case:

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


def _conditions_hold(prep: _Prepared, case: Case) -> bool:
    for c in prep.conditions:
        if isinstance(c, Call) and c.name in COMPARISONS:
            a, b = (_scalar(x, case.scalars) for x in c.args)
            if not COMPARISONS[c.name](a, b):
                return False
    return True


def check_case(rule: RuleSpec, prep: _Prepared, case: Case) -> None:
    """Raise _Failure when the case breaks an obligation."""
    approx = rule.approx or Approx(0.0)
    for o in prep.obligations:
        if o.kind != "eq":
            continue
        exact = _Eval(case.values, case.scalars, case.dtype, exact=True)
        lhs, rhs = exact.value(o.lhs), exact.value(o.rhs)  # type: ignore[arg-type]
        ok, mabs, mrel = allclose_report(rhs, lhs, "fp64", scale=exact.scale, extra_atol=approx.abs, extra_rtol=approx.rel)
        if not ok:
            raise _Failure(_detail(o, case, "exact (fp64, K = identity)", lhs, rhs, mabs, mrel))
        if exact.scale > _max_finite(case.dtype) / 4:
            continue  # out of the dtype's range: stores overflow; only the exact check applies
        dev = _Eval(case.values, case.scalars, case.dtype, exact=False)
        lhs, rhs = dev.value(o.lhs), dev.value(o.rhs)  # type: ignore[arg-type]
        ok, mabs, mrel = allclose_report(
            rhs, lhs, case.dtype, scale=max(dev.scale, exact.scale), extra_atol=approx.abs, extra_rtol=approx.rel
        )
        if not ok:
            raise _Failure(_detail(o, case, f"device (fp32 registers, stores in {case.dtype})", lhs, rhs, mabs, mrel))


def _max_finite(dtype: str) -> float:
    return STORAGE_DTYPES[dtype].max_finite


def _fmt(x: Any, limit: int = 8) -> str:
    a = np.asarray(x, dtype=np.float64).ravel()
    body = ", ".join(f"{v:.6g}" for v in a[:limit])
    return f"[{body}{', …' if a.size > limit else ''}]"


def _detail(o: Obligation, case: Case, level: str, lhs: Any, rhs: Any, mabs: float, mrel: float) -> dict[str, Any]:
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


# ---------------------------------------------------------------- checking


def _structural(o: Obligation, prep: _Prepared) -> str | None:
    """Why a Mem/Ew fact the rule asserts may be false (None when it holds)."""
    t = o.lhs
    declared = {c.args[0] for c in prep.conditions if isinstance(c, Call) and c.name == o.kind}
    if t in declared:
        return None
    if o.kind == "Forced":
        return None  # a planning hint (the value is stored anyway): it never changes a value
    if o.kind == "Mem":
        if isinstance(t, Call) and t.name in ("K", "In", "CublasLt"):
            return None
        return f"asserts (Mem {t}) but {t} is not a stored value (K, In or CublasLt)"
    if isinstance(t, Call) and t.name in OPS and OPS[t.name].kind.fuses:
        return None
    return f"asserts (Ew {t}) but {t} is not computed by an elementwise op"


_STORES = ("K", "CublasLt")


def _stored_subterms(t: Term, root: bool = True) -> set[Term]:
    out: set[Term] = set()
    if isinstance(t, Call):
        if t.name in _STORES and not root:
            out.add(t)
        for a in t.args:
            out |= _stored_subterms(a, False)
    return out


def _new_store(o: Obligation, both_ways: bool) -> Term | None:
    """A stored (K/CublasLt) subterm the rewritten-to side adds that the other lacks: a new
    tensor no graph node names.  A stored root replacing a stored root (K -> CublasLt) is the
    same tensor; dropping a store (fusion) is what rules are for."""
    assert o.rhs is not None
    for a, b in ((o.lhs, o.rhs), (o.rhs, o.lhs))[: 2 if both_ways else 1]:
        have = _stored_subterms(a) | ({a} if isinstance(a, Call) and a.name in _STORES else set())
        extra = _stored_subterms(b) - have
        if isinstance(b, Call) and b.name in _STORES and b not in have and not (isinstance(a, Call) and a.name in _STORES):
            extra.add(b)
        if extra:
            return sorted(extra, key=str)[0]
    return None


def check_rule(rule: RuleSpec, examples: int = DEFAULT_EXAMPLES, seed: int = 0, *, shrink: bool = True) -> RuleResult:
    """Check one rule on ``examples`` random instantiations (hypothesis; ``shrink``: minimise
    a counterexample, which costs a few seconds per unsound rule)."""
    try:
        prep = prepare(rule)
    except _Unsupported as exc:
        return RuleResult(rule, "unsupported", detail=str(exc))
    except ValueError as exc:
        return RuleResult(rule, "invalid", detail=str(exc))
    for o in prep.obligations:
        if o.kind in RELATIONS:
            why = _structural(o, prep)
            if why:
                return RuleResult(rule, "UNSOUND", detail=why)
    if not any(o.kind == "eq" for o in prep.obligations):
        return RuleResult(rule, "sound", detail="adds no equalities (only facts it shows hold, or new terms)")
    if not prep.schemes:
        return RuleResult(rule, "invalid", detail="no shapes make both sides well-typed under the op table")
    result = _search(rule, prep, examples, seed, shrink)
    for o in prep.obligations:
        stray = _new_store(o, both_ways=rule.kind != "rewrite") if o.kind == "eq" else None
        if result.ok and stray is not None:
            detail = f"stores a value the other side does not: {stray} (plans store only graph nodes' values)"
            return RuleResult(rule, "unsupported", result.cases, detail)
    return result


def _search(rule: RuleSpec, prep: _Prepared, examples: int, seed: int, shrink: bool) -> RuleResult:

    progress = {"tried": 0, "failed": False}  # cases evaluated up to the first failure (not shrinking)
    last: list[dict[str, Any]] = []

    @hseed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        print_blob=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else []),
    )
    @given(st.data())
    def prop(data: Any) -> None:

        case = _draw_case(data, prep)
        assume(_conditions_hold(prep, case))
        if not progress["failed"]:
            progress["tried"] += 1
        try:
            check_case(rule, prep, case)
        except _Failure as exc:
            progress["failed"] = True
            last[:] = [exc.detail]
            raise

    try:
        with with_reporter(lambda _msg: None):
            prop()
    except _Failure as exc:
        d = last[0] if last else exc.detail
        return RuleResult(rule, "UNSOUND", int(progress["tried"]), _summary(d), d)
    except _Unsupported as exc:
        return RuleResult(rule, "unsupported", int(progress["tried"]), str(exc))
    except Unsatisfiable:
        return RuleResult(rule, "unsupported", 0, "its :when conditions never held on random cases")
    except (OpError, ArithmeticError, LookupError, TypeError, ValueError) as exc:
        # the op table refused an instantiation the shape derivation allowed: name it, do not crash
        return RuleResult(rule, "unsupported", int(progress["tried"]), f"cannot evaluate the rule: {type(exc).__name__}: {exc}")
    detail = f"documented approximation abs {rule.approx.abs:g} rel {rule.approx.rel:g}" if rule.approx else ""
    return RuleResult(rule, "sound", int(progress["tried"]), detail)


def _summary(d: dict[str, Any]) -> str:
    shapes = ", ".join(f"{k}{tuple(v)}" for k, v in d["shapes"].items())
    ins = "; ".join(f"{k} = {_fmt(v)}" for k, v in d["inputs"].items())
    sc = "".join(f"; {k} = {v:g}" for k, v in d["scalars"].items())
    return (
        f"{d['level']}, {d['dtype']}: shapes {shapes}; inputs {ins}{sc}; "
        f"max abs error {d['max_abs']:.3g}, max rel error {d['max_rel']:.3g} "
        f"(at {tuple(d['worst_index'])}: lhs {d['lhs_at']:.6g}, rhs {d['rhs_at']:.6g})"
    )


# ---------------------------------------------------------------- files


def check_text(
    text: str,
    path: str,
    *,
    shipped: bool = False,
    examples: int = DEFAULT_EXAMPLES,
    seed: int = 0,
    shrink: bool = True,
) -> list[RuleResult]:
    return [check_rule(r, examples, seed, shrink=shrink) for r in rules_of(path, text, shipped=shipped)]


def check_files(
    paths: Sequence[str | Path] = (), *, examples: int = DEFAULT_EXAMPLES, seed: int = 0
) -> list[RuleResult]:
    """Check rule files (none: the shipped rules).  RuleFileError if one does not parse."""
    if not paths:
        files = [(rf.path if rf.path.startswith("generated:") else f"rewrite_rules/{Path(rf.path).name}", rf.text, True)
                 for rf in shipped_rules()]
    else:
        files = [(str(p), read_rule_file(p), False) for p in paths]
    out: list[RuleResult] = []
    for path, text, shipped in files:
        out += check_text(text, path, shipped=shipped, examples=examples, seed=seed)
    return out


def refuse_unsound(path: str, text: str, examples: int = 50, seed: int = 0) -> None:
    """The planner's gate for user rule files: raise naming the first rule not found sound."""
    for res in check_text(text, path, shipped=False, examples=examples, seed=seed, shrink=False):
        if not res.ok:
            raise UnsoundRuleError(
                f"{res.rule.label}: rule {res.rule.text} is {res.verdict}: {res.detail} "
                "(run `fusion-planner check-rules` on the file for details)"
            )


def verdict_counts(results: Iterable[RuleResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    return counts


__all__ = [
    "Approx",
    "Case",
    "RuleResult",
    "RuleSpec",
    "UnsoundRuleError",
    "arg_sorts",
    "check_files",
    "check_rule",
    "check_text",
    "prepare",
    "refuse_unsound",
    "rules_of",
]

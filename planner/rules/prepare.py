"""Preparing a rule for checking: the sorts of its pattern variables, the tensors it names, and their shapes,
solved from the op table's shape rules run on symbolic dimensions that unify when compared."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.core.dtypes import DTYPES as STORAGE_DTYPES
from planner.core.kinds import OpKind
from planner.core.ops import CUBLASLT_EPILOGUES, OPS, OpError, epilogue_has_bias
from planner.rules.terms import (
    COMPARISONS,
    RELATIONS,
    SCALAR_FNS,
    Call,
    Lit,
    Obligation,
    RuleSpec,
    Term,
    Unsupported,
    Var,
    arg_sorts,
)

log = logging.getLogger(__name__)

DTYPES = tuple(STORAGE_DTYPES)
#: dimension sizes drawn for each shape variable: 1, odd sizes, non-multiples of 8 (shrinks to 1)
DIMS = (1, 2, 3, 5, 7, 8, 13, 17)
#: value magnitudes drawn for tensors: unit, tiny, large
MAGNITUDES = (1.0, 1e-3, 30.0, 1e3)
ZERO_FRACTIONS = (0.0, 0.3, 1.0)
MAX_RANK = 3


# ---------------------------------------------------------------- preparing a rule


@dataclass
class Prepared:
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


def substitute(t: Term, binds: Mapping[str, Term], depth: int = 0) -> Term:
    if depth > 64:
        raise Unsupported("cyclic variable bindings")
    if isinstance(t, Var) and t.name in binds:
        return substitute(binds[t.name], binds, depth + 1)
    if isinstance(t, Call):
        return Call(t.name, tuple(substitute(a, binds, depth + 1) for a in t.args))
    return t


def infer_sorts(t: Term, sorts: dict[str, str], want: str) -> None:
    """Infer variable sorts; raise Unsupported for unknown constructors, ValueError if ill-typed."""
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
            infer_sorts(a, sorts, want if want in ("f64", "i64") else "scalar")
        return
    if t.name in RELATIONS:
        if len(t.args) != 1:
            raise ValueError(f"{t.name} takes one argument")
        infer_sorts(t.args[0], sorts, "Op")
        return
    want_args = arg_sorts(t.name)
    if want_args is None:
        raise Unsupported(f"unknown constructor {t.name!r} (not in the op table or the rule language)")
    if len(t.args) != len(want_args):
        raise ValueError(f"{t.name} takes {len(want_args)} argument(s), got {len(t.args)}")
    if t.name == "CublasLt" and not (isinstance(t.args[3], Lit) and t.args[3].value in CUBLASLT_EPILOGUES):
        raise Unsupported(
            f"CublasLt epilogue {t.args[3]} (must be a literal of {', '.join(CUBLASLT_EPILOGUES)})"
        )
    if t.name == "Opaque" and not isinstance(t.args[0], Lit):
        raise Unsupported("Opaque with a variable implementation name")
    for a, s in zip(t.args, want_args, strict=True):
        if t.name in ("In", "Opaque") and s == "String" and isinstance(a, Var):
            continue  # names only: a tensor's identity, not a value
        infer_sorts(a, sorts, s)


def string_choices(t: Term, out: dict[str, tuple[str, ...]]) -> None:
    """The values each String variable may take: those of the op-table attribute it stands for (Cast's dtype)."""
    if not isinstance(t, Call):
        return
    op = OPS.get(t.name)
    if op is not None and op.kind not in (OpKind.INPUT, OpKind.OPAQUE):
        for spec, a in zip(op.attrs, t.args[op.arity or 0:], strict=False):
            if isinstance(a, Var) and spec.sort == "String" and spec.choices:
                out[a.name] = spec.choices
    for a in t.args:
        string_choices(a, out)


def leaves_of(t: Term, sorts: Mapping[str, str], out: dict[Term, None]) -> None:
    if isinstance(t, Var) and sorts.get(t.name) == "Op":
        out[t] = None
    elif isinstance(t, Call):
        if t.name == "In":
            out[t] = None
            return
        for a in t.args:
            leaves_of(a, sorts, out)


def prepare(rule: RuleSpec) -> Prepared:
    if rule.problem:
        raise Unsupported(rule.problem)
    binds = dict(rule.bindings)
    obs = [
        Obligation(o.kind, substitute(o.lhs, binds), None if o.rhs is None else substitute(o.rhs, binds))
        for o in rule.obligations
    ]
    conds = [substitute(c, binds) for c in rule.conditions]
    creates = [substitute(c, binds) for c in rule.creates]
    sorts: dict[str, str] = {}
    for o in obs:
        for side in (o.lhs, o.rhs):
            if side is not None:
                infer_sorts(side, sorts, "Op")
    for c in conds:
        infer_sorts(c, sorts, "bool" if isinstance(c, Call) and c.name in COMPARISONS else "Op")
    for c in creates:
        infer_sorts(c, sorts, "Op")
    leaves: dict[Term, None] = {}
    for t in [*(x for o in obs for x in (o.lhs, o.rhs) if x is not None), *conds, *creates]:
        leaves_of(t, sorts, leaves)
    stored: set[Term] = {lf for lf in leaves if isinstance(lf, Call)}
    stored |= {c.args[0] for c in conds if isinstance(c, Call) and c.name == "Mem"}
    prep = Prepared(obs, conds, creates, sorts, list(leaves), stored)
    for t in [*(x for o in obs for x in (o.lhs, o.rhs) if x is not None), *creates]:
        string_choices(t, prep.choices)
    unknown = sorted(v for v, sort in sorts.items() if sort == "String" and v not in prep.choices)
    if unknown:
        raise Unsupported(f"String variable {unknown[0]} of no attribute with listed values")
    solve_shapes(prep)
    return prep


# ---------------------------------------------------------------- shapes


class Dim:
    """A symbolic dimension: comparing two unifies them (the rule must type-check); comparing one with a
    number fixes it to that size (a reduction's kept dimension is 1)."""

    __slots__ = ("parent", "n", "size")

    def __init__(self, n: int) -> None:
        self.parent: Dim = self
        self.n = n
        self.size: int | None = None

    def find(self) -> Dim:
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
        if not isinstance(other, Dim):
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


def shape_of(t: Term, env: Mapping[Term, Any], scalars: Mapping[str, Any]) -> Any:
    """Output shape of a tensor term (shapes may be symbolic); OpError if ill-typed."""
    if t in env:
        return env[t]
    assert isinstance(t, Call), t
    if t.name == "K":
        return shape_of(t.args[0], env, scalars)
    if t.name == "NoBias":
        return None
    if t.name == "CublasLt":
        a, b, bias = (shape_of(x, env, scalars) for x in t.args[:3])
        epi = str(t.args[3].value)  # type: ignore[union-attr]
        if (bias is not None) != epilogue_has_bias(epi):
            raise OpError(f"CublasLt {epi}: bias {'missing' if bias is None else 'given'}")
        out = OPS["MatMul"].out_shape([a, b], {})
        for op in CUBLASLT_EPILOGUES[epi]:
            out = OPS[op].out_shape([out, bias] if op == "BiasAdd" else [out], {})
        return out
    if t.name == "Opaque":
        ins = [shape_of(x, env, scalars) for x in oplist(t.args[2])]
        impl = str(t.args[0].value)  # type: ignore[union-attr]
        symbolic = any(isinstance(d, Dim) for s in ins for d in s)
        if symbolic and impl in SHAPE_OVERRIDES:
            return SHAPE_OVERRIDES[impl](ins)
        return OPS["Opaque"].out_shape(ins, {"impl": impl})
    opdef = OPS[t.name]
    ins = [shape_of(x, env, scalars) for x in t.args[: opdef.arity]]
    if any(s is None for s in ins):
        raise OpError(f"{t.name}: NoBias is only a CublasLt bias")
    return opdef.out_shape(ins, attrs_of(t, scalars))


def oplist(t: Term) -> list[Term]:
    out = []
    while isinstance(t, Call) and t.name == "Cons":
        out.append(t.args[0])
        t = t.args[1]
    if not (isinstance(t, Call) and t.name == "Nil"):
        raise Unsupported(f"Opaque input list {t} (must be explicit Cons/Nil)")
    return out


def tensor_terms(prep: Prepared) -> list[Term]:
    out: list[Term] = []
    for o in prep.obligations:
        out += [x for x in (o.lhs, o.rhs) if x is not None]
    out += [c for c in prep.conditions if not (isinstance(c, Call) and (c.name in RELATIONS or c.name in COMPARISONS))]
    return out + prep.creates


def attention_shape(shapes: Sequence[Any]) -> Any:
    q, k, v = shapes
    if len(q) != 2 or len(k) != 2 or len(v) != 2:
        raise OpError("attention takes 2-D q, k, v")
    _ = (k == v, q[1] == k[1])  # unify: k and v alike, one model dim (heads=1 in rules)
    return q


#: hand-written symbolic shape rules, only for registered Opaque implementations whose
#: shape rule does arithmetic on dimensions (the op table's own rules need none)
SHAPE_OVERRIDES: dict[str, Callable[[Sequence[Any]], Any]] = {"attention": attention_shape}


class AnyScalar(dict):
    """Attribute variables while deriving shapes: the op table's shape rules ignore their values."""

    def __missing__(self, key: str) -> int:
        return 1


def solve_shapes(prep: Prepared) -> None:
    """Every rank assignment under which the shape rules hold, with unified dims."""
    combos = sorted(itertools.product(range(1, MAX_RANK + 1), repeat=len(prep.leaves)), key=lambda r: (sum(r), r))
    for ranks in combos:
        counter = itertools.count()
        env = {lf: tuple(Dim(next(counter)) for _ in range(r)) for lf, r in zip(prep.leaves, ranks, strict=True)}
        try:
            for o in prep.obligations:
                if o.kind == "eq":
                    left, right = shape_of(o.lhs, env, AnyScalar()), shape_of(o.rhs, env, AnyScalar())  # type: ignore[arg-type]
                    if left is None or right is None or len(left) != len(right):
                        raise OpError("sides differ in rank")
                    _ = left == right
            for t in tensor_terms(prep):
                shape_of(t, env, AnyScalar())
        except (OpError, IndexError, ValueError):  # this rank assignment does not type-check
            continue
        except TypeError as exc:
            raise Unsupported(f"a shape rule the checker cannot run symbolically ({exc})") from None
        roots: dict[int, int] = {}
        scheme = {
            lf: tuple(roots.setdefault(id(d.find()), len(roots)) for d in dims) for lf, dims in env.items()
        }
        prep.schemes.append(scheme)
        prep.n_dims.append(len(roots))
        prep.fixed.append({roots[id(d.find())]: size for dims in env.values() for d in dims
                           if (size := d.find().size) is not None})


def attrs_of(t: Call, scalars: Mapping[str, Any]) -> dict[str, Any]:
    op = OPS[t.name]
    vals = t.args[op.arity or 0 :]
    out = {}
    for spec, v in zip(op.attrs, vals, strict=True):
        out[spec.name] = scalar_of(v, scalars)
    return out


def scalar_of(t: Term, scalars: Mapping[str, Any]) -> Any:
    if isinstance(t, Lit):
        return t.value
    if isinstance(t, Var):
        return scalars[t.name]
    assert isinstance(t, Call)
    return SCALAR_FNS[t.name](*(scalar_of(a, scalars) for a in t.args))

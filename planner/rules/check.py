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

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, assume, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from hypothesis.reporting import with_reporter

from planner.core.ops import OPS, OpError
from planner.rules.evaluate import Case, Failure, check_case, conditions_hold, draw_case, fmt_value
from planner.rules.files import RuleFileError, read_rule_file, shipped_rules
from planner.rules.prepare import Prepared, prepare
from planner.rules.terms import (
    DEFAULT_EXAMPLES,
    RELATIONS,
    Approx,
    Call,
    Obligation,
    RuleSpec,
    Term,
    Unsupported,
    arg_sorts,
    rules_of,
)

log = logging.getLogger(__name__)


class UnsoundRuleError(RuleFileError):
    """A user rule file holds a rule the checker does not find sound."""


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


# ---------------------------------------------------------------- checking


def _structural(o: Obligation, prep: Prepared) -> str | None:
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
    except Unsupported as exc:
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


def _search(rule: RuleSpec, prep: Prepared, examples: int, seed: int, shrink: bool) -> RuleResult:

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

        case = draw_case(data, prep)
        assume(conditions_hold(prep, case))
        if not progress["failed"]:
            progress["tried"] += 1
        try:
            check_case(rule, prep, case)
        except Failure as exc:
            progress["failed"] = True
            last[:] = [exc.detail]
            raise

    try:
        with with_reporter(lambda _msg: None):
            prop()
    except Failure as exc:
        d = last[0] if last else exc.detail
        return RuleResult(rule, "UNSOUND", int(progress["tried"]), _summary(d), d)
    except Unsupported as exc:
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
    ins = "; ".join(f"{k} = {fmt_value(v)}" for k, v in d["inputs"].items())
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

"""Rules as the soundness checker reads them: terms (:class:`Var`, :class:`Lit`, :class:`Call`), a rule's
obligations (``lhs == rhs``, or a structural fact) and :func:`rules_of`, which parses a rule file with egglog's
own parser."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from planner.core.kinds import OpKind
from planner.core.ops import OPS
from planner.rules.files import parse_rule_forms

log = logging.getLogger(__name__)

#: instantiations a rule is checked on (here, not in the checker: the CLI reads it without loading hypothesis)
DEFAULT_EXAMPLES = 100

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


def term_of(e: Any) -> Term:
    kind = type(e).__name__
    if kind == "Var":
        return Var(e.name)
    if kind == "Lit":
        return Lit(getattr(e.value, "value", None))
    if kind == "Call":
        return Call(e.name, tuple(term_of(a) for a in e.args))
    raise Unsupported(f"expression {e!r}")


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


class Unsupported(Exception):
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
        except Unsupported as exc:
            short = {"RewriteCommand": "rewrite", "BiRewriteCommand": "birewrite"}.get(kind, "rule")
            out.append(RuleSpec(kind=short, bindings=(), conditions=(), obligations=(), problem=str(exc), **base))
    return out


def _refuse_removals(cmd: Any, kind: str) -> None:
    """What a user rule may not do, however sound: remove a form (``delete``, ``subsume``: it may be the
    unfused form every plan falls back on, or a graph input), or fire with no query (its terms are not the
    graph's)."""
    if kind == "RuleCommand":
        if not cmd.rule.body:
            raise Unsupported("a rule with no query: it adds terms that are not the graph's (a user rule "
                               "must match something)")
        if any(type(a).__name__ == "Change" for a in cmd.rule.head):
            raise Unsupported("delete or subsume in a user rule: removing a form can remove the unfused "
                               "form every plan falls back on, or a graph input (user rules may only add)")
    elif getattr(cmd, "subsume", False):
        raise Unsupported(":subsume in a user rewrite: it removes the matched form, which can be the unfused "
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
            left, right = term_of(f.left), term_of(f.right)
            if isinstance(left, Var):
                binds.append((left.name, right))
            elif isinstance(right, Var):
                binds.append((right.name, left))
            else:
                raise Unsupported(f"equality between two patterns {left} = {right}")
        else:
            conds.append(term_of(f.expr))
    return binds, conds


def _from_rewrite(rw: Any, kind: str, base: dict[str, Any]) -> RuleSpec:
    binds, conds = _facts(rw.conditions)
    ob = Obligation("eq", term_of(rw.lhs), term_of(rw.rhs))
    return RuleSpec(kind=kind, bindings=tuple(binds), conditions=tuple(conds), obligations=(ob,), **base)


def _from_rule(rule: Any, base: dict[str, Any]) -> RuleSpec:
    binds, conds = _facts(rule.body)
    obs: list[Obligation] = []
    creates: list[Term] = []
    for act in rule.head:
        kind = type(act).__name__
        if kind == "Union":
            obs.append(Obligation("eq", term_of(act.lhs), term_of(act.rhs)))
        elif kind == "Let":
            binds.append((act.lhs, term_of(act.rhs)))
        elif kind == "Expr_":
            t = term_of(act.expr)
            if isinstance(t, Call) and t.name in RELATIONS:
                obs.append(Obligation(t.name, t.args[0]))
            else:
                creates.append(t)
        elif kind == "Change":
            pass  # subsume/delete only removes an alternative: it adds no equality, so no value changes
        else:
            raise Unsupported(f"action {kind} (rule actions may be union, let, terms, subsume and Mem/Ew/Forced facts)")
    return RuleSpec(
        kind="rule",
        bindings=tuple(binds),
        conditions=tuple(conds),
        obligations=tuple(obs),
        creates=tuple(creates),
        **base,
    )



"""Mechanical fusion rules, generated from the op table.

For every elementwise op and every input it lists in ``fusable_inputs``, three
rules follow from the op's signature alone, so they are generated here rather
than typed out per op:

* **register read** (ruleset ``elementwise``): the op may read that input from
  registers when an elementwise op computes it, ``(Op .. (K x) ..) -> (Op .. x ..)``
  when ``(Ew x)``. ``(K x)`` only stores ``x``, so both sides compute the same value.
* **GEMM epilogue** (ruleset ``epilogue``): the op may take a GEMM result from
  registers, ``(Op .. (K (MatMul a b)) ..) -> (Op .. (MatMul a b) ..)``; the kernel
  computes the product and applies the op in its epilogue. An op opts out with
  ``OpDef.gemm_epilogue = False``, or lists the inputs that may (``Div``: the dividend only).
* **subsume a recomputation** (ruleset ``limits``): when every plan stores that input
  (``Forced``), recomputing it in registers only adds traffic, so the register form is
  subsumed. It adds no equality.

Hand-written ``.egg`` files keep only what is not mechanical (the cuBLASLt epilogues
and the Mem/Forced derivations). Generated rules go through the same soundness
checker as every other rule (``fusion-planner check-rules``), labelled ``generated:<ruleset>``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from planner.core.ops import OPS, OpDef

#: pseudo-paths of the generated rule texts, in the order they are scheduled
GENERATED_RULESETS = ("limits", "elementwise", "epilogue")
_TENSOR_VARS = ("x", "y", "z", "w")


@dataclass(frozen=True)
class GeneratedRule:
    ruleset: str
    op: str
    input: int
    text: str
    comment: str


def _vars(op: OpDef) -> list[str]:
    """Pattern variables of an op's constructor: its tensor inputs, then its attributes."""
    return list(_TENSOR_VARS[: op.arity or 0]) + [f"attr_{a.name}" for a in op.attrs]


def _term(op: OpDef, args: Iterable[str]) -> str:
    return f"({op.name} {' '.join(args)})"


def _with(args: list[str], i: int, replacement: str) -> list[str]:
    return [replacement if j == i else a for j, a in enumerate(args)]


def fusion_rules(ops: Iterable[OpDef] | None = None) -> list[GeneratedRule]:
    """The three mechanical rules of every (elementwise op, fusable input), in op-table order."""
    out: list[GeneratedRule] = []
    for op in ops if ops is not None else OPS.values():
        if not op.kind.fuses:
            continue
        args = _vars(op)
        plain = _term(op, args)
        for i in op.fusable_inputs:
            x = args[i]
            out.append(GeneratedRule(
                "elementwise", op.name, i,
                f"(rewrite {_term(op, _with(args, i, f'(K {x})'))} {plain} :when ((Ew {x})) :ruleset elementwise)",
                f"{op.name} reads input {i} from registers when an elementwise op computes it; K only stores it.",
            ))
            if op.takes_gemm_input(i):
                gemm = "(MatMul gemm_a gemm_b)"
                out.append(GeneratedRule(
                    "epilogue", op.name, i,
                    f"(rewrite {_term(op, _with(args, i, f'(K {gemm})'))} {_term(op, _with(args, i, gemm))} "
                    ":ruleset epilogue)",
                    f"{op.name} takes input {i} from a GEMM in registers: the GEMM kernel applies it as an epilogue.",
                ))
            out.append(GeneratedRule(
                "limits", op.name, i,
                f"(rule ((= e {plain}) (Forced {x})) ((subsume {plain})) :ruleset limits)",
                f"{op.name} recomputing its input {i}, which every plan stores anyway, only adds traffic: subsume it.",
            ))
    return out


def generated_text(ruleset: str, rules: Iterable[GeneratedRule] | None = None) -> str:
    """The rule-file text of one generated ruleset (``limits`` is declared by limits.egg)."""
    chosen = [r for r in (rules if rules is not None else fusion_rules()) if r.ruleset == ruleset]
    lines = [f"; GENERATED from the op table (planner/rules/rulegen.py) -- ruleset {ruleset}; do not edit"]
    if ruleset != "limits":
        lines.append(f"(ruleset {ruleset})")
    for r in chosen:
        lines += [f"; {r.comment} (generated: {r.op} input {r.input})", r.text]
    return "\n".join(lines) + "\n"

"""The egglog program: datatypes from the op table, one ``let`` per node, rules.

The unfused program wraps every op in the materialisation marker ``K``: ``(K x)``
means "a kernel computes x and stores it".  Rule files add register forms and
library alternatives; saturation runs in stages (elementwise, then epilogue,
then cuBLASLt, then user rules) under iteration, node-count and time limits.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rewrite_rules
from planner.graph import Graph, Node
from planner.ops import OPS
from planner.rulegen import generated_text

log = logging.getLogger(__name__)

RULES_DIR = Path(rewrite_rules.__file__).resolve().parent
#: shipped rules in declaration order: hand-written files and ``generated:<ruleset>`` texts from the op table
SHIPPED_RULE_FILES = ("limits.egg", "generated:limits", "generated:elementwise", "generated:epilogue", "cublaslt.egg")
#: saturation stages: analysis facts always run with each stage
STAGES = ("elementwise", "epilogue", "cublaslt", "user")
ANALYSIS_RULESETS = ("analysis", "limits")

_SORT_OF_ATTR = {"f64": "f64", "i64": "i64", "String": "String"}


class RuleFileError(ValueError):
    """A rule file does not parse or holds commands a rule file may not."""


# ---------------------------------------------------------------- prelude


def prelude() -> str:
    """Datatype declarations and analysis rules, generated from the op table."""
    ctors = ["  (In String)", "  (K Op)", "  (NoBias)"]
    ew_rules = []
    for op in OPS.values():
        if op.kind in ("input", "opaque"):
            continue
        args = ["Op"] * (op.arity or 0) + [_SORT_OF_ATTR[a.sort] for a in op.attrs]
        ctors.append(f"  ({op.name} {' '.join(args)})")
        if op.kind == "elementwise":
            vars_ = " ".join(f"v{i}" for i in range(len(args)))
            ew_rules.append(
                f"(rule ((= e ({op.name} {vars_}))) ((Ew e)) :ruleset analysis)"
            )
    ctors.append("  (CublasLt Op Op Op String)")
    return "\n".join(
        [
            "(datatype Op",
            *ctors,
            ")",
            "(datatype OpList (Nil) (Cons Op OpList))",
            "(constructor Opaque (String String OpList) Op)",
            "(relation Mem (Op))",
            "(relation Ew (Op))",
            "; a value every plan stores (read by a GEMM or an Opaque op, or a graph output)",
            "(relation Forced (Op))",
            "(ruleset analysis)",
            "; a value computed by an elementwise op (may be fused into its consumer)",
            *ew_rules,
        ]
    )


# ---------------------------------------------------------------- rule files


@dataclass(frozen=True)
class RuleFile:
    path: str
    text: str
    shipped: bool


_USER_ALLOWED = {"RewriteCommand", "BiRewriteCommand", "RuleCommand", "AddRuleset"}
_SHIPPED_ALLOWED = _USER_ALLOWED | {"Datatype", "Datatypes", "Constructor", "Relation", "Sort", "FunctionCommand"}


def parse_rule_text(text: str, path: str, *, shipped: bool) -> list[Any]:
    """Parse with egglog's own parser; refuse commands a rule file may not hold."""
    from egglog import bindings

    try:
        cmds = bindings.EGraph().parse_program(text)
    except Exception as exc:  # egglog raises EggSmolError
        msg = " ".join(str(exc).split())
        m = re.search(r"In (\d+):(\d+)", msg)
        where = f"{path}:{m.group(1)}" if m else path
        raise RuleFileError(f"{where}: does not parse: {msg}") from None
    allowed = _SHIPPED_ALLOWED if shipped else _USER_ALLOWED
    for cmd in cmds:
        name = type(cmd).__name__
        if name not in allowed:
            line, keyword = _where(text, cmd)
            raise RuleFileError(
                f"{path}:{line}: a {'shipped' if shipped else 'user'} rule file may hold only "
                f"rewrite, birewrite, rule and ruleset commands; found ({keyword} …)"
            )
    return cmds


def _where(text: str, cmd: Any) -> tuple[int, str]:
    """Line and keyword of a parsed command, from egglog's source span where it has one."""
    span = getattr(cmd, "span", None)
    for attr in ("schedule", "rule", "rewrite"):
        span = span or getattr(getattr(cmd, attr, None), "span", None)
    data = text.encode()
    if span is not None:
        m = re.match(rb"\(\s*([^\s()]+)", data[span.i :])
        return data.count(b"\n", 0, span.i) + 1, m.group(1).decode() if m else str(cmd).split()[0].lstrip("(")
    head = str(cmd).split()[0].lstrip("(") if str(cmd).split() else str(cmd)
    for i, line in enumerate(text.splitlines(), 1):  # spanless commands (push): first line opening with it
        if re.match(rf"\s*\(\s*{re.escape(head)}\b", line):
            return i, head
    return 1, head


def shipped_rules() -> list[RuleFile]:
    """The hand-written rule files and the rules generated from the op table (planner/rulegen.py)."""
    out = []
    for f in SHIPPED_RULE_FILES:
        if f.startswith("generated:"):
            out.append(RuleFile(f, generated_text(f.removeprefix("generated:")), True))
        else:
            out.append(RuleFile(str(RULES_DIR / f), (RULES_DIR / f).read_text(), True))
    return out


def user_rules(paths: Iterable[str | Path], *, check: bool = True) -> list[RuleFile]:
    """User rule files: only rule commands, and (``check``) every rule found sound by
    :mod:`planner.rulecheck`; an unsound rule raises ``UnsoundRuleError`` naming it."""
    out = []
    for p in paths:
        path = Path(p)
        try:
            text = path.read_text()
        except OSError as exc:
            raise RuleFileError(f"{path}: cannot read rule file: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise RuleFileError(f"{path}: rule file is not UTF-8 text (byte {exc.start})") from None
        parse_rule_text(text, str(path), shipped=False)
        if check:
            from planner.rulecheck import refuse_unsound

            refuse_unsound(str(path), text)
        out.append(RuleFile(str(path), text, False))
    return out


# ---------------------------------------------------------------- program


def let_name(index: int) -> str:
    """The egglog global naming the graph's ``index``-th node (ids never reach egglog names)."""
    return f"$n{index}"


def node_term(node: Node, graph: Graph) -> str:
    """The unfused term of one node: every computed input read from memory."""
    if node.op == "In":
        return f'(In "{node.id}")'
    pos = {n.id: i for i, n in enumerate(graph.nodes)}
    args = [let_name(pos[i]) for i in node.inputs]
    attrs = node.attr_dict
    if node.op == "Opaque":
        lst = "(Nil)"
        for a in reversed(args):
            lst = f"(Cons {a} {lst})"
        return f'(K (Opaque "{attrs["impl"]}" "{node.id}" {lst}))'
    op = OPS[node.op]
    lits = [_literal(attrs[a.name], a.sort) for a in op.attrs]
    return f"(K ({node.op} {' '.join(args + lits)}))"


def _literal(v: Any, sort: str) -> str:
    if sort == "f64":
        s = repr(float(v))
        return s if ("." in s or "e" in s or "inf" in s or "nan" in s) else s + ".0"
    if sort == "i64":
        return str(int(v))
    return json.dumps(str(v))


def graph_program(graph: Graph) -> str:
    lines = [f"(let {let_name(i)} {node_term(n, graph)})" for i, n in enumerate(graph.nodes)]
    pos = {n.id: i for i, n in enumerate(graph.nodes)}
    for o in dict.fromkeys(graph.outputs):
        if graph[o].op != "In":  # an output is stored by every plan: (K v) -> v is Forced
            lines.append(f"(rule ((= m {let_name(pos[o])}) (= m (K v))) ((Forced v)) :ruleset analysis)")
    return "\n".join(lines)


# ---------------------------------------------------------------- saturation


@dataclass(frozen=True)
class Limits:
    """Bounds on saturation and extraction; ``docs/cost-model.md`` gives defaults."""

    max_iterations: int = 32  # per stage
    max_nodes: int = 500_000
    time_limit_s: float = 10.0
    max_region_ops: int = 16  # ops in one fused kernel (enforced by the extractor)
    max_bodies_per_root: int = 512  # kernel bodies considered per stored value


@dataclass
class SaturationResult:
    serialized: dict[str, Any]
    enodes: int
    iterations: int
    limit_hit: str | None
    build_s: float
    saturate_s: float
    stage_iterations: dict[str, int] = field(default_factory=dict)


def saturate(graph: Graph, rules: Sequence[RuleFile], limits: Limits) -> SaturationResult:
    from egglog import bindings

    t0 = time.perf_counter()
    eg = bindings.EGraph()
    eg.run_program(*eg.parse_program(prelude()))
    for rf in rules:
        try:
            eg.run_program(*eg.parse_program(rf.text))
        except Exception as exc:
            raise RuleFileError(f"{rf.path}: egglog rejected the rules: {str(exc).strip()}") from None
    user_sets = _user_rulesets(rules)
    eg.run_program(*eg.parse_program(graph_program(graph)))
    build_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    limit_hit: str | None = None
    total_iters = 0
    stage_iters: dict[str, int] = {}
    analysis = " ".join(f"(saturate (run {r}))" for r in ANALYSIS_RULESETS)
    for stage in STAGES:
        rulesets = user_sets if stage == "user" else [stage]
        if not rulesets:
            continue
        step = " ".join(f"(run {r})" for r in rulesets)
        cmds = eg.parse_program(f"(run-schedule {analysis} {step})")
        iters = 0
        while True:
            out = eg.run_program(*cmds)
            iters += 1
            updated = out[0].report.updated
            if not updated:
                break
            if iters >= limits.max_iterations:
                limit_hit = f"iteration limit ({limits.max_iterations}) in stage {stage}"
                break
            if time.perf_counter() - t1 > limits.time_limit_s:
                limit_hit = f"time limit ({limits.time_limit_s}s) in stage {stage}"
                break
            if _size(eg) > limits.max_nodes:
                limit_hit = f"node limit ({limits.max_nodes}) in stage {stage}"
                break
        stage_iters[stage] = iters
        total_iters += iters
        if limit_hit:
            log.warning("saturation stopped early: %s; the plan stays valid", limit_hit)
            break
    # analysis facts must be complete for whatever was added before a limit hit
    eg.run_program(*eg.parse_program(f"(run-schedule {analysis})"))
    ser = eg.serialize([], max_functions=None, max_calls_per_function=None, include_temporary_functions=False)
    data = json.loads(ser.to_json())
    saturate_s = time.perf_counter() - t1
    enodes = sum(1 for n in data["nodes"].values() if not n["eclass"].startswith(("@", "String", "f64", "i64")))
    return SaturationResult(data, enodes, total_iters, limit_hit, build_s, saturate_s, stage_iters)


def _size(eg: Any) -> int:
    out = eg.run_program(*eg.parse_program("(print-size)"))
    return sum(n for _, n in out[0].sizes)


def _user_rulesets(rules: Sequence[RuleFile]) -> list[str]:
    """Rulesets user files declare, plus the default ruleset where they use it."""
    names: list[str] = []
    for rf in rules:
        if rf.shipped:
            continue
        names += re.findall(r"\(\s*ruleset\s+([^\s()]+)\s*\)", rf.text)
        if re.search(r"\((?:rewrite|birewrite|rule)\b", rf.text) and not _all_have_ruleset(rf.text):
            names.append("")
    return list(dict.fromkeys(names))


def _all_have_ruleset(text: str) -> bool:
    forms = re.findall(r"\((?:rewrite|birewrite|rule)\b", text)
    return len(re.findall(r":ruleset\b", text)) >= len(forms)

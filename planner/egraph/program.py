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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from egglog import bindings

from planner.core.graph import Graph, Node
from planner.core.kinds import OpKind
from planner.core.ops import OPS
from planner.rules.files import RuleFile, RuleFileError, programs

log = logging.getLogger(__name__)

#: saturation stages: analysis facts always run with each stage
STAGES = ("elementwise", "epilogue", "cublaslt", "user")
ANALYSIS_RULESETS = ("analysis", "limits")

_SORT_OF_ATTR = {"f64": "f64", "i64": "i64", "String": "String"}


# ---------------------------------------------------------------- prelude


def prelude() -> str:
    """Datatype declarations and analysis rules, generated from the op table."""
    ctors = ["  (In String)", "  (K Op)", "  (NoBias)"]
    ew_rules = []
    for op in OPS.values():
        if op.kind in (OpKind.INPUT, OpKind.OPAQUE):
            continue
        args = ["Op"] * (op.arity or 0) + [_SORT_OF_ATTR[a.sort] for a in op.attrs]
        ctors.append(f"  ({op.name} {' '.join(args)})")
        if op.kind.fuses:
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


# ---------------------------------------------------------------- program


def let_name(index: int) -> str:
    """The egglog global naming the graph's ``index``-th node (ids never reach egglog names)."""
    return f"$n{index}"


def node_term(node: Node, pos: Mapping[str, int]) -> str:
    """The unfused term of one node: every computed input read from memory (``pos``: node id -> index)."""
    if node.op == "In":
        return f'(In "{node.id}")'
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


#: commands per egglog program run while the graph is loaded: parsing and running one program costs
#: egglog time and memory quadratic in its length (a 4,000-line program of lets: 3.8 GB and 4 s; in runs of
#: 64 lines: 0.1 GB and 0.4 s; egglog 13.2, measured 2026-12-01)
PROGRAM_CHUNK = 64


def graph_commands(graph: Graph) -> list[str]:
    """One ``let`` per node (linear in the graph: each node's inputs are looked up by position), but for an
    input no op reads and no output names: every ruleset iteration scans the ``In`` nodes, and a graph file
    of 100,000 inputs, 64 of them read, took 90 s to saturate with them all."""
    pos = {n.id: i for i, n in enumerate(graph.nodes)}
    read = {i for n in graph.ops for i in n.inputs} | set(graph.outputs)
    lines = [f"(let {let_name(i)} {node_term(n, pos)})" for i, n in enumerate(graph.nodes)
             if n.op != "In" or n.id in read]
    for o in dict.fromkeys(graph.outputs):
        if graph[o].op != "In":  # an output is stored by every plan: (K v) -> v is Forced
            lines.append(f"(rule ((= m {let_name(pos[o])}) (= m (K v))) ((Forced v)) :ruleset analysis)")
    return lines


# ---------------------------------------------------------------- saturation


@dataclass(frozen=True)
class Limits:
    """Bounds on saturation and extraction; ``docs/cost-model.md`` gives defaults."""

    max_iterations: int = 32  # per stage
    max_nodes: int = 500_000
    time_limit_s: float = 10.0
    max_region_ops: int = 64  # ops in one fused kernel (enforced by the extractor)
    max_bodies_per_root: int = 512  # kernel bodies considered per stored value
    max_segment_ops: int = 1024  # ops in one e-graph: a longer graph is planned in segments (core.regions)


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

    t0 = time.perf_counter()
    eg = bindings.EGraph()
    eg.run_program(*eg.parse_program(prelude()))
    for rf in rules:
        try:
            for text in programs(rf.text, rf.path):
                eg.run_program(*eg.parse_program(text))
        except Exception as exc:
            raise RuleFileError(f"{rf.path}: egglog rejected the rules: {str(exc).strip()}") from None
    user_sets = _user_rulesets(rules)
    lines = graph_commands(graph)
    for start in range(0, len(lines), PROGRAM_CHUNK):
        eg.run_program(*eg.parse_program("\n".join(lines[start : start + PROGRAM_CHUNK])))
    build_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    limit_hit: str | None = None
    total_iters = 0
    stage_iters: dict[str, int] = {}
    analysis = eg.parse_program(" ".join(f"(run-schedule (saturate (run {r})))" for r in ANALYSIS_RULESETS))
    n_rules = max(1, sum(len(re.findall(r"\((?:rewrite|birewrite|rule)\b", rf.text)) for rf in rules))
    budget = _NodeBudget(limits.max_nodes, n_rules)
    size = _size(eg)
    for stage in STAGES:
        rulesets = user_sets if stage == "user" else [stage]
        if not rulesets:
            continue
        iters = 0
        plain = eg.parse_program(" ".join(f"(run-schedule (run {r}))" for r in rulesets))
        while True:
            eg.run_program(*analysis)
            if stage == "user":
                updated, size, held = budget.iteration(eg, rulesets, size)
            else:  # the shipped rules grow the e-graph linearly in the graph: whole iterations, checked between
                out = eg.run_program(*plain)
                updated = any(o.report.updated for o in out if isinstance(o, bindings.RunScheduleOutput))
                size, held = _size(eg), {}
            iters += 1
            if held:
                limit_hit = (f"node limit ({limits.max_nodes}) in stage {stage}: {len(held)} rule(s) with more "
                             f"matches ({max(held.values()):,}) than the node budget left could take were not applied")
                break
            if not updated:
                break
            if iters >= limits.max_iterations:
                limit_hit = f"iteration limit ({limits.max_iterations}) in stage {stage}"
                break
            if time.perf_counter() - t1 > limits.time_limit_s:
                limit_hit = f"time limit ({limits.time_limit_s}s) in stage {stage}"
                break
            if size > limits.max_nodes:
                limit_hit = f"node limit ({limits.max_nodes}) in stage {stage}"
                break
        stage_iters[stage] = iters
        total_iters += iters
        if limit_hit:
            log.warning("saturation stopped early: %s; the plan stays valid", limit_hit)
            break
    # analysis facts must be complete for whatever was added before a limit hit
    eg.run_program(*analysis)
    ser = eg.serialize([], max_functions=None, max_calls_per_function=None, include_temporary_functions=False)
    data = json.loads(ser.to_json())
    saturate_s = time.perf_counter() - t1
    enodes = sum(1 for n in data["nodes"].values() if not n["eclass"].startswith(("@", "String", "f64", "i64")))
    return SaturationResult(data, enodes, total_iters, limit_hit, build_s, saturate_s, stage_iters)


#: how far past ``max_nodes`` one iteration may take the e-graph
NODE_OVERSHOOT = 1.5
#: re-runs of one iteration for the rules its first match limit held back
MAX_RETRIES = 4


@dataclass
class _NodeBudget:
    """Keeps each iteration of the user rules within about ``NODE_OVERSHOOT`` x ``max_nodes``.

    egglog applies an iteration's matches all at once, so the limit is enforced by the match limit of its
    back-off scheduler (a rule with more matches than the limit applies none of them): every rule may apply
    an equal share of the budget left, counted in matches at the largest growth per applied match seen so
    far (at first ``growth``). Rules held back are run again in the same iteration under the share of what
    is then left among just them, while the smallest of them fits; those that do not are reported and
    saturation stops at the node limit. One iteration of associativity on a 16-term sum had taken the
    e-graph 5.5x past the limit before."""

    max_nodes: int
    n_rules: int
    growth: float = 2.0  # e-nodes per applied match (a right-hand side's new terms; measured as it runs)

    def iteration(self, eg: Any, rulesets: Sequence[str], size: int) -> tuple[bool, int, dict[str, int]]:
        """One iteration; returns (updated, new size, held-back rules -> their matches)."""
        updated, size, held = self._step(eg, rulesets, size, self.n_rules)
        for _ in range(MAX_RETRIES):
            if not held or self._limit(size, len(held)) < min(held.values()):
                break
            again, size, held = self._step(eg, rulesets, size, len(held))
            updated = updated or again
        return updated, size, held

    def _limit(self, size: int, rules: int) -> int:
        return int((self.max_nodes * NODE_OVERSHOOT - size) / (self.growth * rules))

    def _step(self, eg: Any, rulesets: Sequence[str], size: int, rules: int) -> tuple[bool, int, dict[str, int]]:
        limit = max(1, self._limit(size, rules))
        updated, applied, held = _run_with_match_limit(eg, rulesets, limit)
        after = _size(eg)
        if applied:
            self.growth = max(self.growth, (after - size) / applied)
        return updated, after, held


def _run_with_match_limit(eg: Any, rulesets: Sequence[str], limit: int) -> tuple[bool, int, dict[str, int]]:
    """One iteration of ``rulesets``, each rule applying at most ``limit`` matches: (updated, matches
    applied, rules held back -> their matches)."""
    step = " ".join(f"(run-with bo {r})" for r in rulesets)
    out = eg.run_program(*eg.parse_program(f"(run-schedule (let-scheduler bo (back-off :match-limit {limit})) {step})"))
    report = out[0]
    assert isinstance(report, bindings.RunScheduleOutput), report  # what run-schedule answers
    held: dict[str, int] = {}
    applied = 0
    for it in report.report.iterations:
        for rule, reports in it.rule_set_report.rule_reports.items():
            n = max((r.num_matches for r in reports), default=0)
            if n > limit:
                held[rule] = max(held.get(rule, 0), n)
            else:
                applied += n
    return report.report.updated and not _only_held(report, held), applied, held


def _only_held(report: Any, held: dict[str, int]) -> bool:
    """Did the iteration change nothing but report its held-back rules as unfinished?"""
    return bool(held) and not any(it.rule_set_report.changed for it in report.report.iterations)


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

"""The planning pipeline: graph -> e-graph -> extraction -> costed candidates."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.core.cost import DeviceSpec, load_device
from planner.core.examples import ew_chain, mlp_epilogue, transformer
from planner.core.graph import Graph
from planner.core.plans import Plan, rename_kernel
from planner.core.reference import execute_graph, execute_plan, random_inputs
from planner.core.regions import Region, split_regions
from planner.core.report import Count, count_json, log10_count
from planner.core.tolerance import check_outputs
from planner.egraph.extract import ExtractionError, Extractor, Option, view_egraph
from planner.egraph.program import Limits, saturate
from planner.rules.files import RuleFile, RuleFileError
from planner.rules.load import load_rules

log = logging.getLogger(__name__)

DEFAULT_CAP = 4096
DEFAULT_K = 16


@dataclass
class CandidateSet:
    """Costed candidate plans of one graph, best first."""

    graph: Graph
    spec: DeviceSpec
    plans: list[Plan]
    space: Count
    complete: bool
    enodes: int
    iterations: int
    limit_hit: str | None
    times: dict[str, float]
    extractor: Extractor
    choices: dict[str, dict[str, Option]] = field(default_factory=dict, repr=False)
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Plan:
        return self.plans[0]

    @property
    def unfused(self) -> Plan:
        return self.extractor.plan_of(self.extractor.unfused())

    def to_json(self) -> dict[str, Any]:
        best_key = self.best.key
        cands = []
        for p in self.plans:
            d = p.to_json()
            d["best"] = p.key == best_key
            cands.append(d)
        return {
            "graph": self.graph.name,
            "device": self.spec.name,
            "space": count_json(self.space),
            "space_log10": round(log10_count(self.space), 4),
            "enumerated": self.complete,
            "enodes": self.enodes,
            "iterations": self.iterations,
            "limit_hit": self.limit_hit,
            "times_s": {k: round(v, 6) for k, v in self.times.items()},
            "notes": self.notes,
            "candidates": cands,
        }


#: the best plan of each sub-region a seed is stitched from, by (structure, device, rules, limits): the
#: regions of a layer stack share their pieces (a LayerNorm, the attention), each saturated once per process
_REGION_BEST: dict[tuple[Any, ...], Plan] = {}
_REGION_BEST_MAX = 256


def _region_best(r: Region, spec: DeviceSpec, rules: tuple[RuleFile, ...], limits: Limits) -> Plan:
    memo = (r.key, repr(spec), rules, limits)
    if memo not in _REGION_BEST:
        if len(_REGION_BEST) >= _REGION_BEST_MAX:
            _REGION_BEST.clear()
        _REGION_BEST[memo] = build_candidates(r.graph, spec, rules=list(rules), limits=limits, k=1, keep_all=False).best
    return _REGION_BEST[memo]


def _region_seed(graph: Graph, ex: Extractor, spec: DeviceSpec, rules, limits) -> list[dict[str, Option]]:
    """The per-region best plans, stitched and refined: exact within each region
    (regions are cut at forced stores, so the optimum decomposes over them)."""

    regions = split_regions(graph, repeats=False)
    if len(regions) < 2:
        return []
    kernels = []
    for r in regions:
        names = r.renaming()
        kernels += [rename_kernel(kk, names) for kk in _region_best(r, spec, tuple(rules), limits).kernels]
    choice = ex.choice_from_kernels(kernels)
    return [ex.improve(choice)] if choice is not None else []


def build_candidates(
    graph: Graph,
    spec: DeviceSpec,
    *,
    rules: Sequence[RuleFile] | None = None,
    limits: Limits | None = None,
    cap: int = DEFAULT_CAP,
    k: int = DEFAULT_K,
    seed: int = 0,
    keep_all: bool = True,
) -> CandidateSet:
    """Saturate, extract and cost candidates.

    Every plan is listed when the space holds at most ``cap`` plans (``keep_all=False``: only
    the best ``k`` of them, by exact cost, become Plan objects: a seed needs the best, and a
    LayerNorm's 1,120 plans took 0.3 s to build); otherwise the best plan (tree DP refined by
    exact local search), its one-kernel neighbours and seeded uniform samples are costed and
    the best ``k`` kept. The unfused plan is always kept.
    """
    limits = limits or Limits()
    rules = load_rules() if rules is None else list(rules)
    user = [rf.path for rf in rules if not rf.shipped]
    try:
        return _build(graph, spec, rules, limits, cap, k, seed, keep_all)
    except ExtractionError as exc:
        if not user:
            raise
        raise RuleFileError(f"{', '.join(user)}: with these rules {graph.name} has no valid plan: {exc}") from None
    except BaseException as exc:  # egglog panics raise pyo3's PanicException, a BaseException
        if not user or type(exc).__name__ != "PanicException":
            raise
        raise RuleFileError(f"{', '.join(user)}: egglog failed running these rules on {graph.name}: {exc}") from None


def _build(graph: Graph, spec: DeviceSpec, rules: list[RuleFile], limits: Limits, cap: int, k: int, seed: int,
           keep_all: bool) -> CandidateSet:
    sat = saturate(graph, rules, limits)
    t0 = time.perf_counter()
    ex = Extractor(graph, view_egraph(sat.serialized, graph), spec, limits.max_region_ops, limits.max_bodies_per_root)
    space = ex.space_size()
    choices: list[dict[str, Option]]
    if space <= cap:
        choices, complete = ex.enumerate(cap)
    else:
        choices, complete = [], False
    if not complete:
        best = min([ex.dp_best(), *_region_seed(graph, ex, spec, rules, limits)], key=ex.cost)
        choices = [best, ex.unfused(), *ex.neighbours(best), *ex.sample(k, seed)]
    by_key: dict[str, dict[str, Option]] = {}
    for c in choices:
        by_key.setdefault(ex.key(c), c)
    keep = len(by_key) if complete and keep_all else k
    if len(by_key) > keep:
        # rank by exact cost before building plans: only the kept ones become Plan objects
        unfused_key = ex.key(ex.unfused())
        ranked = sorted(by_key, key=lambda key: (round(ex.cost(by_key[key]), 6), key))[:keep]
        if unfused_key not in ranked:
            ranked.append(unfused_key)
        by_key = {key: by_key[key] for key in ranked}
    plans = sorted((ex.plan_of(c) for c in by_key.values()), key=Plan.sort_key)
    extract_s = time.perf_counter() - t0
    notes = list(ex.notes)
    if sat.limit_hit:
        notes.insert(0, f"saturation stopped at the {sat.limit_hit}; candidates are still valid")
    log.info("%s: %d ops, %d e-nodes after %d iterations (%.2fs to build, %.2fs to saturate%s); %s plans in the space, "
             "%d kept (%s) in %.2fs", graph.name, len(graph.ops), sat.enodes, sat.iterations, sat.build_s,
             sat.saturate_s, f", stopped at the {sat.limit_hit}" if sat.limit_hit else "", f"{space:,}", len(plans),
             "enumerated" if complete else "sampled around the cheapest", extract_s)
    for n in notes:
        log.info("%s", n)
    return CandidateSet(
        graph=graph,
        spec=spec,
        plans=plans,
        space=space,
        complete=complete,
        enodes=sat.enodes,
        iterations=sat.iterations,
        limit_hit=sat.limit_hit,
        times={"build": sat.build_s, "saturate": sat.saturate_s, "extract": extract_s},
        extractor=ex,
        choices={p.key: by_key[p.key] for p in plans if p.key in by_key},
        notes=notes,
    )


def planner_problem(rule_file: RuleFile) -> str | None:
    """Why the planner fails with this (sound) rule file on the small built-in graphs, or None: the rule
    checker runs every file it passes through the planner, so that what it calls sound cannot crash a plan."""
    rules = [*load_rules(), rule_file]
    for graph in (ew_chain(3, 64), mlp_epilogue(16, 16, 16, "fp32"), transformer(1, 32, 8, "fp32")):
        try:
            cands = build_candidates(graph, load_device("h200"), rules=rules, cap=64, k=2)
            x = random_inputs(graph, 0)
            problem, _, _ = check_outputs(cands.best, execute_plan(cands.best, x), execute_graph(graph, x))
        except Exception as exc:
            return f"planning {graph.name} with it fails: {type(exc).__name__}: {exc}"
        if problem:
            return f"the plan of {graph.name} chosen with it does not match the reference: {problem}"
    return None

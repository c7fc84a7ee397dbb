"""Whole-model planning: plan each unique region once, reuse it for every instance.

``plan_model`` splits the graph into regions (``planner.core.regions``), plans each
unique region (its own e-graph, extraction and choice), caches the choice on disk
and instantiates it for every region with the same structural hash.  The result
is one composite plan over the whole graph.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from planner.core.cost import DeviceSpec
from planner.core.graph import Graph
from planner.core.plans import Kernel, Plan, compose_plan, rename_kernel
from planner.core.regions import Region, boundaries, split_regions
from planner.egraph.candidates import CandidateSet, build_candidates
from planner.egraph.program import Limits
from planner.model.plancache import PlanCache
from planner.rules.files import RuleFile
from planner.rules.load import load_rules, rules_hash

log = logging.getLogger(__name__)

Chooser = Callable[[CandidateSet], Plan]
#: plans the distinct regions it is given (the first instance of each), yielding each one's plan as it is made:
#: in any order (a cluster finishes them out of order); each is stored in the plan cache as it arrives
RegionSearch = Callable[[Sequence["Region"]], Iterable["RegionPlan"]]


def cost_model_choice(cands: CandidateSet) -> Plan:
    return cands.best


@dataclass
class RegionPlan:
    key: str
    region: Region  # the first instance
    plan: Plan  # chosen plan in canonical names
    instances: int = 0
    cached: bool = False
    unfused: Plan | None = None  # one kernel per op, canonical names (None when the plan came from the cache)
    stats: dict[str, float] = field(default_factory=dict)  # e-nodes and times of its search

    @classmethod
    def searched(cls, region: Region, plan: Plan, cands: CandidateSet) -> RegionPlan:
        """A region planned now: its candidates are not kept (a long graph's segments would hold every
        segment's e-graph extraction at once), only the unfused plan and the figures."""
        stats = dict(cands.times, enodes=cands.enodes, iterations=cands.iterations)
        return cls(region.key, region, plan, 1, unfused=cands.unfused, stats=stats)


@dataclass
class ModelPlan:
    graph: Graph
    spec: DeviceSpec
    regions: list[Region]
    unique: dict[str, RegionPlan]
    plan: Plan
    times: dict[str, float] = field(default_factory=dict)
    dedup: bool = True
    rules: Sequence[RuleFile] = ()
    limits: Limits | None = None
    _unfused: Plan | None = None

    @property
    def unfused(self) -> Plan:
        """One kernel per op over the whole graph (built on first use)."""
        if self._unfused is None:
            self._unfused = _unfused_composite(self.graph, self.spec, self.rules, self.limits, self.regions, self.unique)
        return self._unfused

    @property
    def cache_hits(self) -> int:
        return sum(1 for u in self.unique.values() if u.cached)

    @functools.cached_property
    def notes(self) -> list[str]:
        """What the limits changed: a graph longer than one e-graph may hold is cut into segments (where its
        forced stores alone leave a piece longer than the limit)."""
        ops, limit = len(self.graph.ops), (self.limits or Limits()).max_segment_ops
        if ops <= limit or (self.dedup and boundaries(self.graph, limit) == boundaries(self.graph)):
            return []
        return [f"{ops:,} ops exceed the segment limit (max_segment_ops={limit:,}, --max-segment-ops): planned in "
                f"{len(self.regions):,} regions of at most {limit:,} ops where a cut exists; no kernel spans a cut"]

    def summary(self) -> dict:
        return {
            "graph": self.graph.name,
            "ops": len(self.graph.ops),
            "regions": len(self.regions),
            "unique_regions": len(self.unique),
            "cache_hits": self.cache_hits,
            "dedup": self.dedup,
            "notes": self.notes,
            "kernels": len(self.plan.kernels),
            "est_us": round(self.plan.est_us, 4),
            "times_s": {k: round(v, 6) for k, v in self.times.items()},
        }


def plan_model(
    graph: Graph,
    spec: DeviceSpec,
    *,
    backend: str = "model",
    choose: Chooser = cost_model_choice,
    rules: Sequence[RuleFile] | None = None,
    limits: Limits | None = None,
    dedup: bool = True,
    cache: PlanCache | None = None,
    cap: int = 4096,
    k: int = 16,
    seed: int = 0,
    regions: Sequence[Region] | None = None,
    search_regions: RegionSearch | None = None,
) -> ModelPlan:
    """Plan a whole model; ``dedup=False`` plans the graph as one e-graph instead (in segments, none
    sharing a plan, when it is longer than the segment limit).  ``regions``: the graph's
    ``split_regions`` under these limits, when the caller has them already.  ``search_regions`` plans the
    distinct regions the plan cache does not answer (default: one after another here, each by ``choose``)."""
    rules = load_rules() if rules is None else list(rules)
    limits = limits or Limits()
    t0 = time.perf_counter()
    if not dedup and len(graph.ops) <= limits.max_segment_ops:
        cands = build_candidates(graph, spec, rules=rules, limits=limits, cap=cap, k=k, seed=seed)
        plan = choose(cands)
        times = dict(cands.times, total=time.perf_counter() - t0)
        whole = Region(0, tuple(n.id for n in graph.ops), (), tuple(graph.outputs), "whole", graph)
        rp = RegionPlan.searched(whole, plan, cands)
        return ModelPlan(graph, spec, [whole], {"whole": rp}, plan, times, dedup=False, limits=limits,
                         _unfused=cands.unfused)

    regions = list(regions) if regions is not None else split_regions(graph, limits.max_segment_ops)
    t_split = time.perf_counter() - t0
    rhash = rules_hash(rules)
    slot = {r.index: r.key if dedup else f"{r.index}:{r.key}" for r in regions}
    found: dict[str, RegionPlan] = {}
    firsts: dict[str, Region] = {}
    for r in regions:
        if slot[r.index] in firsts:
            continue
        firsts[slot[r.index]] = r
        cached = cache.load(PlanCache.key(r.key, spec, backend, rhash), r.graph, spec) if cache else None
        if cached is not None:
            found[slot[r.index]] = RegionPlan(r.key, r, cached, 1, cached=True)
    todo = [r for at, r in firsts.items() if at not in found]
    searcher = search_regions or functools.partial(_choose_each, choose, spec, rules, limits, cap, k, seed)
    for rp in searcher(todo):
        if cache:
            cache.store(PlanCache.key(rp.key, spec, backend, rhash), rp.plan, rp.region.graph, spec)
        found[slot[rp.region.index]] = rp
    missing = [r.graph.name for at, r in firsts.items() if at not in found]
    if missing:
        raise RuntimeError(f"the region search returned no plan for {', '.join(missing)}")
    instances = Counter(slot.values())
    unique = {at: found[at] for at in firsts}  # in the order of first appearance, however they were searched
    for at, rp in unique.items():
        rp.instances = instances[at]
    t_plan = time.perf_counter() - t0 - t_split
    kernels: list[Kernel] = []
    for r in regions:
        names = r.renaming()
        kernels += [rename_kernel(kk, names) for kk in unique[slot[r.index]].plan.kernels]
    plan = compose_plan(graph, kernels, "|".join(unique[slot[r.index]].plan.key for r in regions))
    times = {"split": t_split, "plan_regions": t_plan, "total": time.perf_counter() - t0}
    log.info(
        "%s: %d regions, %d unique, %d from cache", graph.name, len(regions), len(unique),
        sum(1 for u in unique.values() if u.cached),
    )
    mp = ModelPlan(graph, spec, regions, unique, plan, times, dedup=dedup, rules=rules, limits=limits)
    for note in mp.notes:
        log.info("%s: %s", graph.name, note)
    return mp


def _choose_each(choose: Chooser, spec: DeviceSpec, rules: Sequence[RuleFile], limits: Limits, cap: int, k: int,
                 seed: int, todo: Sequence[Region]) -> Iterable[RegionPlan]:
    for r in todo:
        cands = build_candidates(r.graph, spec, rules=rules, limits=limits, cap=cap, k=k, seed=seed)
        yield RegionPlan.searched(r, choose(cands), cands)


def _unfused_composite(graph, spec, rules, limits, regions, unique) -> Plan:
    """One kernel per op over the whole graph (regions from the cache are re-extracted)."""
    kernels: list[Kernel] = []
    by_key = {u.key: u for u in unique.values()}
    for r in regions:
        u = by_key[r.key]
        if u.unfused is None:
            u.unfused = build_candidates(r.graph, spec, rules=rules, limits=limits, cap=1, k=1).unfused
        names = r.renaming()
        kernels += [rename_kernel(kk, names) for kk in u.unfused.kernels]
    return compose_plan(graph, kernels, "unfused")

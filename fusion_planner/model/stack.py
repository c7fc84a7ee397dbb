"""Whole-model planning: plan each unique region once, reuse it for every instance.

``plan_model`` splits the graph into regions (``fusion_planner.core.regions``), plans each
unique region (its own e-graph, extraction and choice), caches the choice on disk
and instantiates it for every region with the same structural hash.  The result
is one composite plan over the whole graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fusion_planner.core.cost import DeviceSpec, load_device
from fusion_planner.core.graph import Graph
from fusion_planner.core.plans import Kernel, Plan, compose_plan, rename_kernel
from fusion_planner.core.regions import Region, split_regions
from fusion_planner.egraph.candidates import CandidateSet, build_candidates
from fusion_planner.egraph.program import Limits
from fusion_planner.model.plancache import PlanCache
from fusion_planner.rules.files import RuleFile
from fusion_planner.rules.load import load_rules, rules_hash

log = logging.getLogger(__name__)

Chooser = Callable[[CandidateSet], Plan]


def cost_model_choice(cands: CandidateSet) -> Plan:
    return cands.best


@dataclass
class RegionPlan:
    key: str
    region: Region  # the first instance
    plan: Plan  # chosen plan in canonical names
    cands: CandidateSet | None  # None when the plan came from the cache
    instances: int = 0
    cached: bool = False


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

    def summary(self) -> dict:
        return {
            "graph": self.graph.name,
            "ops": len(self.graph.ops),
            "regions": len(self.regions),
            "unique_regions": len(self.unique),
            "cache_hits": self.cache_hits,
            "dedup": self.dedup,
            "kernels": len(self.plan.kernels),
            "est_us": round(self.plan.est_us, 4),
            "times_s": {k: round(v, 6) for k, v in self.times.items()},
        }


def plan_model(
    graph: Graph,
    device: str | DeviceSpec | None = None,
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
) -> ModelPlan:
    """Plan a whole model; ``dedup=False`` plans the graph as one e-graph instead."""
    spec = device if isinstance(device, DeviceSpec) else load_device(device)
    rules = load_rules() if rules is None else list(rules)
    t0 = time.perf_counter()
    if not dedup:
        cands = build_candidates(graph, spec, rules=rules, limits=limits, cap=cap, k=k, seed=seed)
        plan = choose(cands)
        times = dict(cands.times, total=time.perf_counter() - t0)
        whole = Region(0, tuple(n.id for n in graph.ops), (), tuple(graph.outputs), "whole", graph)
        rp = RegionPlan("whole", whole, plan, cands, 1)
        return ModelPlan(graph, spec, [whole], {"whole": rp}, plan, times, dedup=False, _unfused=cands.unfused)

    regions = split_regions(graph)
    t_split = time.perf_counter() - t0
    unique: dict[str, RegionPlan] = {}
    rhash = rules_hash(rules)
    for r in regions:
        if r.key in unique:
            unique[r.key].instances += 1
            continue
        cache_key = PlanCache.key(r.key, spec, backend, rhash) if cache else ""
        cached = cache.load(cache_key, r.graph, spec) if cache else None
        if cached is not None:
            unique[r.key] = RegionPlan(r.key, r, cached, None, 1, cached=True)
            continue
        cands = build_candidates(r.graph, spec, rules=rules, limits=limits, cap=cap, k=k, seed=seed)
        chosen = choose(cands)
        if cache:
            cache.store(cache_key, chosen, r.graph, spec)
        unique[r.key] = RegionPlan(r.key, r, chosen, cands, 1)
    t_plan = time.perf_counter() - t0 - t_split
    kernels: list[Kernel] = []
    for r in regions:
        kernels += [rename_kernel(kk, r.renaming()) for kk in unique[r.key].plan.kernels]
    plan = compose_plan(graph, kernels, "|".join(unique[r.key].plan.key for r in regions))
    times = {"split": t_split, "plan_regions": t_plan, "total": time.perf_counter() - t0}
    log.info(
        "%s: %d regions, %d unique, %d from cache", graph.name, len(regions), len(unique),
        sum(1 for u in unique.values() if u.cached),
    )
    return ModelPlan(graph, spec, regions, unique, plan, times, dedup=True, rules=rules, limits=limits)


def _unfused_composite(graph, spec, rules, limits, regions, unique) -> Plan:
    """One kernel per op over the whole graph (regions from the cache are re-extracted)."""
    per_key: dict[str, Plan] = {}
    kernels: list[Kernel] = []
    for r in regions:
        if r.key not in per_key:
            cands = unique[r.key].cands or build_candidates(r.graph, spec, rules=rules, limits=limits, cap=1, k=1)
            per_key[r.key] = cands.unfused
        kernels += [rename_kernel(kk, r.renaming()) for kk in per_key[r.key].kernels]
    return compose_plan(graph, kernels, "unfused")

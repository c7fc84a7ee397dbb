"""One region's search as a unit of work: what it needs (:class:`RegionJob`), how it runs (:func:`search_region`,
the same here and on a cluster's worker) and how a wall-time budget is shared between the regions (:class:`Budget`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from planner.backend import Backend
from planner.core.cost import DeviceSpec
from planner.core.ops import OPS
from planner.core.regions import Region
from planner.egraph.candidates import CandidateSet, build_candidates
from planner.egraph.program import Limits
from planner.model.stack import RegionPlan
from planner.rules.files import RuleFile
from planner.search.engine import search
from planner.search.results import SearchOptions, SearchResult
from planner.search.searchlog import SearchLog

#: the least budget a region's search gets: with the whole budget spent, a search still compares the cost
#: model's favourite with the unfused baseline (the search always considers those two)
MIN_REGION_BUDGET_S = 1e-3


@dataclass(frozen=True)
class RegionJob:
    """A region to search, with everything its e-graph and its search take; ``inputs`` (a graph searched whole
    on the module's own values) else the input recipe."""

    region: Region
    title: str
    spec: DeviceSpec
    rules: tuple[RuleFile, ...]
    limits: Limits | None
    cap: int
    k: int
    options: SearchOptions
    inputs: Mapping[str, np.ndarray] | None = None
    keep_candidates: bool = False  # send the candidate set back with the result (a graph searched whole)


@dataclass
class RegionOutcome:
    """A searched region: its plan (with the unfused one and the e-graph's figures), the search's result, and on
    a cluster the worker that searched it; the candidates only where the caller asked to keep them."""

    plan: RegionPlan
    result: SearchResult
    worker: str = ""
    candidates: CandidateSet | None = None


def search_region(job: RegionJob, backend: Backend, log: SearchLog,
                  tick: Callable[[int, int], None] | None = None) -> RegionOutcome:
    """Build the region's candidates and search them on ``backend`` (raises ``SearchError`` when none verifies);
    ``job.options.time_budget_s`` is this region's share of the budget."""
    cands = build_candidates(job.region.graph, job.spec, rules=job.rules, limits=job.limits, cap=job.cap, k=job.k,
                             seed=job.options.seed)
    result = search(cands, backend, job.inputs, options=job.options, log=log, on_candidate=tick)
    return RegionOutcome(RegionPlan.searched(job.region, result.best, cands), result,
                         candidates=cands if job.keep_candidates else None)


def work(region: Region) -> float:
    """A region's FLOPs plus the bytes its ops write, summed op by op: a cluster starts the largest regions first,
    so that none of them is left to run alone at the end."""
    graph = region.graph
    return sum(OPS[n.op].flops(n.type.shape, [graph[x].type.shape for x in n.inputs], n.attr_dict) + n.type.nbytes
               for n in graph.ops)


class Budget:
    """``--time-budget`` bounds the whole search: the regions still to search share what is left of it, a share
    per region searched at once (regions answered by the cache count as pending, so a share is never too large)."""

    def __init__(self, total_s: float, pending: int) -> None:
        self.deadline = time.perf_counter() + total_s
        self.pending = pending

    def share(self, at_once: int = 1) -> float:
        left = max(self.deadline - time.perf_counter(), 0.0)
        return max(left * min(at_once, self.pending) / max(self.pending, 1), MIN_REGION_BUDGET_S)

    def done(self) -> None:
        self.pending = max(self.pending - 1, 0)

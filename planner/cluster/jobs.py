"""One region's search as a unit of work: what it needs (:class:`RegionJob`), how it runs (:func:`search_region`,
the same here and on a cluster's worker) and how a wall-time budget is shared between the regions (:class:`Budget`)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from planner.backend import Backend
from planner.core.cost import DeviceSpec
from planner.core.ops import OPS
from planner.core.plans import Plan
from planner.core.reference import recipe_inputs
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
    #: (k, n): this job searches part k of n of the region (every n-th of the cost model's candidates from the
    #: k-th, its share of the candidate limit, its own seed for the genetic phase); (0, 1): all of it
    part: tuple[int, int] = (0, 1)
    #: the parts' best plans: this job compares them with the unfused plan, interleaved, on one device
    finalists: tuple[Plan, ...] = ()
    #: the region's share of its whole graph's estimated time, its instances counted (a small one's search is brief)
    share: float = 1.0

    def with_budget(self, seconds: float) -> RegionJob:
        """This job with ``seconds`` of search budget (its share of ``--time-budget`` when it starts)."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, time_budget_s=seconds))

    @property
    def stage(self) -> str:
        if self.finalists:
            return "final"
        return "whole" if self.part[1] == 1 else f"part {self.part[0] + 1}/{self.part[1]}"


@dataclass
class RegionOutcome:
    """A searched region: its plan (with the unfused one and the e-graph's figures), the search's result, and on
    a cluster the worker that searched it; the candidates only where the caller asked to keep them."""

    plan: RegionPlan
    result: SearchResult
    job: RegionJob
    worker: str = ""
    candidates: CandidateSet | None = None


def search_region(job: RegionJob, backend: Backend, log: SearchLog,
                  tick: Callable[[int, int], None] | None = None) -> RegionOutcome:
    """Build the region's candidates and search them, or the part of them or the finalists ``job`` names, on
    ``backend`` (raises ``SearchError`` when none verifies); ``job.options.time_budget_s`` is its budget share."""
    cands = build_candidates(job.region.graph, job.spec, rules=job.rules, limits=job.limits, cap=job.cap, k=job.k,
                             seed=job.options.seed)
    inputs = job.inputs
    if inputs is None and job.stage != "whole":  # the parts' seeds differ; they verify and time on one set of inputs
        inputs, _ = recipe_inputs(job.region.graph, seed=job.options.seed)
    searched, options = _narrowed(cands, job)
    result = search(searched, backend, inputs, options=options, log=log, on_candidate=tick, share=job.share)
    return RegionOutcome(RegionPlan.searched(job.region, result.best, cands), result, job,
                         candidates=searched if job.keep_candidates else None)


def _narrowed(cands: CandidateSet, job: RegionJob) -> tuple[CandidateSet, SearchOptions]:
    """The candidates and options of the job's stage (every part verifies and times on the same inputs)."""
    if job.finalists:
        return dataclasses.replace(cands, plans=list(job.finalists), complete=True), job.options
    k, n = job.part
    if n == 1:
        return cands, job.options
    limit = max(1, math.ceil(job.options.max_candidates / n))
    return (dataclasses.replace(cands, plans=cands.plans[k::n]),
            dataclasses.replace(job.options, seed=job.options.seed + k, max_candidates=limit))


class Parts:
    """A cluster's regions searched in parts: each part's outcome is kept until the region's last is back, then the
    region's final job is due; the final's outcome, merged with its parts', is the region's."""

    def __init__(self) -> None:
        self.back: dict[int, list[RegionOutcome]] = {}

    def split(self, job: RegionJob, parts: int) -> list[RegionJob]:
        """The job as ``parts`` parts (where more than one)."""
        return [dataclasses.replace(job, part=(k, parts)) for k in range(parts)] if parts > 1 else [job]

    def after(self, outcome: RegionOutcome) -> tuple[RegionOutcome | None, list[RegionJob]]:
        """(the region's outcome where this one completes it, the jobs now due); each log line now names the
        worker that measured it."""
        outcome.result.log_lines = [f"[{outcome.worker}] {line}" for line in outcome.result.log_lines]
        job = outcome.job
        if job.part[1] == 1 and not job.finalists:
            return outcome, []
        held = self.back.setdefault(job.region.index, [])
        if job.finalists:
            del self.back[job.region.index]
            return merged(held, outcome), []
        held.append(outcome)
        if len(held) < job.part[1]:
            return None, []
        bests = {o.result.best.key: o.result.best for o in held}
        final = dataclasses.replace(job, part=(0, 1), finalists=tuple(sorted(bests.values(), key=Plan.sort_key)))
        return None, [final]


def merged(parts: Sequence[RegionOutcome], final: RegionOutcome) -> RegionOutcome:
    """One region's outcome from its parts and its final comparison: the final's choice and figures, every part's
    candidates and log lines before the final's (each line already names its worker), the parts' stop."""
    seen = {e.plan.key for e in final.result.entries}
    entries = list(final.result.entries)
    for outcome in parts:
        for entry in outcome.result.entries:
            if entry.plan.key not in seen:
                seen.add(entry.plan.key)
                entries.append(entry)
    lines = [line for outcome in parts for line in outcome.result.log_lines] + final.result.log_lines
    elapsed = max(o.result.elapsed_s for o in parts) + final.result.elapsed_s
    result = dataclasses.replace(final.result, entries=entries, log_lines=lines, elapsed_s=elapsed,
                                 stop=parts[0].result.stop, space=parts[0].result.space,
                                 enumerated=parts[0].result.enumerated)
    workers = ",".join(dict.fromkeys([*(o.worker for o in parts), final.worker]))
    return dataclasses.replace(final, result=result, worker=workers)


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

"""The one planning pipeline: what ``planner.plan``, ``fusion-planner plan`` and ``torch.compile`` run.

Given a graph and :class:`PlanOptions`, :func:`plan_graph` decides between planning the
graph whole and region by region (a layer stack: each distinct region searched once),
builds the cache key (graph region, device, backend and every search option, rule set),
answers from the plan cache or searches, stores the choice, and for a layer stack checks
the composite plan against the reference on a measuring backend. The faces only turn
their inputs into a graph and options, and present the :class:`Planned` result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.backend import Backend, CompiledPlan
from planner.cluster.jobs import Budget, Parts, RegionJob, RegionOutcome, search_region, work
from planner.cluster.pool import ExecutorOptions, RayPool
from planner.core.cost import DeviceSpec
from planner.core.graph import Graph
from planner.core.plans import Plan, compose_plan, rename_kernel
from planner.core.reference import execute_graph, random_inputs
from planner.core.regions import Region, region_shares, split_regions, whole_graph_region
from planner.core.report import region_title
from planner.core.tolerance import check_outputs
from planner.core.torch_allowlist import trusted_names
from planner.egraph.candidates import DEFAULT_CAP, DEFAULT_K, CandidateSet
from planner.egraph.program import Limits
from planner.model.plancache import PlanCache
from planner.model.stack import ModelPlan, RegionPlan, plan_model
from planner.registry import plugin
from planner.rules.files import RuleFile
from planner.rules.load import rules_hash
from planner.search.engine import SearchError
from planner.search.results import SearchOptions, SearchResult
from planner.search.searchlog import SearchLog
from planner.torch import need_evaluator

log = logging.getLogger(__name__)

Tick = Callable[[int, int], None]
#: a fresh search log (and progress tick) for each search the pipeline runs, given what is searched (the graph's
#: name, or a region's :func:`region_title`)
Progress = Callable[[str], contextlib.AbstractContextManager[tuple[SearchLog, Tick | None]]]


@contextlib.contextmanager
def quiet_progress(label: str = "") -> Iterator[tuple[SearchLog, Tick | None]]:
    """The default: a search log that prints only under SEARCH_LOG=1, no progress bar."""
    yield SearchLog(), None


@dataclass(frozen=True)
class PlanOptions:
    backend_name: str
    spec: DeviceSpec
    rules: Sequence[RuleFile]
    limits: Limits | None = None
    cap: int = DEFAULT_CAP
    k: int = DEFAULT_K
    search: SearchOptions = field(default_factory=SearchOptions)
    dedup: bool = True
    executor: ExecutorOptions = field(default_factory=ExecutorOptions)
    #: plan region by region even where no region repeats (each distinct region its own e-graph and search, the
    #: unit a cluster fans out: the ray executor does so whatever this says); ``dedup=False`` overrides it
    by_region: bool = False
    #: the keyword options the backend was made with (``threads``, ``source``): a cluster's workers make theirs so
    backend_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return self.search.seed

    def cache_tag(self, backend: Backend) -> str:
        """The plan cache's backend field: the backend's identity (the CPU's thread count), every search
        option and every bound on the candidates (saturation and extraction limits, cap, k, dedup), so a
        choice made under a smaller budget, another seed, thread count or kernel-size limit never answers
        another."""
        bounds = {"limits": dataclasses.asdict(self.limits or Limits()), "cap": self.cap, "k": self.k, "dedup": self.dedup}
        choice = {"search": dataclasses.asdict(self.search), **bounds}
        return f"{backend.identity} {json.dumps(choice, sort_keys=True)}"

    def cache_key(self, region: Region, backend: Backend) -> str:
        return PlanCache.key(region.key, self.spec, self.cache_tag(backend), rules_hash(self.rules))

    def splits(self, regions: Sequence[Region]) -> bool:
        """Whether a graph of these regions (more than one) is planned region by region: where regions repeat,
        where asked, and on a cluster."""
        repeats = len({r.key for r in regions}) < len(regions)
        return repeats or self.by_region or self.executor.kind == "ray"

    def job(self, region: Region, inputs: Mapping[str, np.ndarray] | None = None, share: float = 1.0) -> RegionJob:
        return RegionJob(region, region_title(region), self.spec, tuple(self.rules), self.limits, self.cap, self.k,
                         self.search, inputs, share=share)

    def pool(self) -> RayPool:
        """The cluster's workers, each making this backend on its own device."""
        device = plugin(self.backend_name).worker_device
        return RayPool(self.executor, self.backend_name, self.spec, self.backend_options, device, trusted_names())


@dataclass
class Planned:
    """What the pipeline decided: the whole graph's plan and how it was reached."""

    graph: Graph
    plan: Plan
    options: PlanOptions
    candidates: CandidateSet | None = None  # single-region search
    search: SearchResult | None = None
    model: ModelPlan | None = None  # region-wise
    region_searches: dict[str, SearchResult] = field(default_factory=dict)
    composite: dict[str, Any] = field(default_factory=dict)  # region-wise: the whole plan's check and timing
    from_cache: bool = False
    cache_key: str = ""  # a graph searched whole: the key its plan is cached under
    executor_notes: list[str] = field(default_factory=list)  # the cluster's workers and what befell them

    @property
    def log_lines(self) -> list[str]:
        if self.search is not None:
            return list(self.search.log_lines)
        lines = [line for r in self.region_searches.values() for line in r.log_lines]
        if self.model is not None:
            s = self.model.summary()
            lines.append(f"{self.graph.name}: {s['regions']} regions, {s['unique_regions']} distinct, "
                         f"{s['cache_hits']} from the plan cache")
            lines += [f"{self.graph.name}: {note}" for note in s["notes"]]
        elif self.from_cache:
            lines.append(f"{self.graph.name}: plan from the plan cache, not re-searched")
        return lines + self.executor_notes


def plan_graph(
    graph: Graph,
    options: PlanOptions,
    backend: Backend,
    *,
    cache: PlanCache | None,
    progress: Progress = quiet_progress,
    inputs: Mapping[str, np.ndarray] | None = None,
) -> Planned:
    """Plan ``graph`` as the module docstring says; raises :class:`SearchError` when no plan verifies.

    ``inputs`` (default: the input recipe) are what a whole-graph search verifies and times on, and a layer
    stack's composite plan; its regions always use the recipe."""
    need_evaluator(graph)
    live = graph.live()
    if live is not graph:
        log.info("%s: %d op(s) compute values no output depends on; they are left out of the plan", graph.name,
                 len(graph.nodes) - len(live.nodes))
        graph = live
    segment_ops = (options.limits or Limits()).max_segment_ops
    regions = split_regions(graph, segment_ops)
    if len(graph.ops) > segment_ops or (options.dedup and len(regions) > 1 and options.splits(regions)):
        return _plan_regions(graph, regions, options, backend, cache, progress, inputs)
    whole = whole_graph_region(graph)
    key = options.cache_key(whole, backend)
    if cache is not None:
        cached = cache.load(key, whole.graph, options.spec)
        if cached is not None:
            names = whole.renaming()
            full = compose_plan(graph, [rename_kernel(k, names) for k in cached.kernels], cached.key)
            return Planned(graph, full, options, from_cache=True, cache_key=key)
    as_given = dataclasses.replace(whole, graph=graph)  # searched on the graph's own names (``inputs`` use them)
    job = dataclasses.replace(options.job(as_given, inputs), title=graph.name, keep_candidates=True)
    notes: list[str] = []
    if options.executor.kind == "ray":
        (outcome,) = _on_cluster(options, notes, [job], Budget(options.search.time_budget_s, 1), progress,
                                 lambda n, region: graph.name)
    else:
        with progress(graph.name) as (slog, tick):
            outcome = search_region(job, backend, slog, tick)
    result = outcome.result
    if cache is not None and not result.interrupted:  # an interrupted search decided less than asked
        canonical = {g: c for c, g in whole.renaming().items()}
        store = compose_plan(whole.graph, [rename_kernel(k, canonical) for k in result.best.kernels], result.best.key)
        cache.store(key, store, whole.graph, options.spec)
    return Planned(graph, result.best, options, candidates=outcome.candidates, search=result, cache_key=key,
                   executor_notes=notes)


def _plan_regions(graph: Graph, regions: Sequence[Region], options: PlanOptions, backend: Backend,
                  cache: PlanCache | None, progress: Progress, inputs: Mapping[str, np.ndarray] | None) -> Planned:
    searches: dict[str, SearchResult] = {}
    notes: list[str] = []
    pending = len({r.key for r in regions}) if options.dedup else len(regions)
    budget = Budget(options.search.time_budget_s, pending)
    shares = region_shares(regions, options.spec)

    def label(n: int, region: Region) -> str:
        return f"region {n}/{pending} {region_title(region)}"

    def here(todo: Sequence[Region]) -> Iterator[RegionPlan]:
        for region in todo:
            with progress(label(len(searches) + 1, region)) as (slog, tick):
                job = options.job(region, share=shares[region.key]).with_budget(budget.share())
                outcome = search_region(job, backend, slog, tick)
            budget.done()
            searches[region.graph.name] = outcome.result
            yield outcome.plan

    def on_cluster(todo: Sequence[Region]) -> Iterator[RegionPlan]:
        jobs = [options.job(r, share=shares[r.key]) for r in todo]
        for outcome in _on_cluster(options, notes, jobs, budget, progress, label):
            searches[outcome.plan.region.graph.name] = outcome.result
            yield outcome.plan

    mp = plan_model(graph, options.spec, backend=options.cache_tag(backend), rules=options.rules,
                    limits=options.limits, dedup=options.dedup, cache=cache, cap=options.cap, k=options.k,
                    seed=options.seed, regions=regions,
                    search_regions=on_cluster if options.executor.kind == "ray" else here)
    composite = measure_composite(mp, backend, options.search, inputs)
    in_order = {u.region.graph.name: searches[u.region.graph.name] for u in mp.unique.values()
                if u.region.graph.name in searches}  # a cluster's regions arrive in any order
    return Planned(graph, mp.plan, options, model=mp, region_searches=in_order, composite=composite,
                   executor_notes=notes)


@contextlib.contextmanager
def _cluster(options: PlanOptions, notes: list[str]) -> Iterator[RayPool]:
    """The cluster's workers for one planning; afterwards ``notes`` say where the regions ran and what befell the
    workers (the search trail's first line says where it runs, its last lines these notes)."""
    with contextlib.redirect_stdout(sys.stderr):  # Ray prints its reports of a lost worker on stdout: --json's
        pool = options.pool()
        SearchLog().emit(f"Searching on {pool.where}")  # the trail's first line; its last ones say how it went
        try:
            yield pool
        finally:
            pool.close()
            notes += [pool.summary(), *pool.events]
    trail = SearchLog()
    for note in notes:
        trail.emit(note)


def _on_cluster(options: PlanOptions, notes: list[str], jobs: Sequence[RegionJob], budget: Budget,
                progress: Progress, label: Callable[[int, Region], str]) -> Iterator[RegionOutcome]:
    """The jobs' regions searched on the cluster's workers, the largest first; where there are fewer regions than
    workers, each in as many parts as keep every worker busy. Yields each region's outcome as it arrives."""
    if not jobs:
        return
    with _cluster(options, notes) as pool:
        parts = Parts()
        split = pool.size // len(jobs) if len(jobs) < pool.size else 1
        queue = [part for job in sorted(jobs, key=lambda j: work(j.region), reverse=True)
                 for part in parts.split(job, split)]
        yield from _logged_in_order(pool.run(queue, budget, parts.after), [j.region for j in jobs], progress, label)


def _logged_in_order(outcomes: Iterable[RegionOutcome], todo: Sequence[Region], progress: Progress,
                     label: Callable[[int, Region], str]) -> Iterator[RegionOutcome]:
    """Yields each outcome as it arrives; writes the searches' logs (each line naming its worker) as one log in the
    regions' order (a region's log waits for the regions before it)."""
    position = {r.index: i for i, r in enumerate(todo)}
    arrived: dict[int, RegionOutcome] = {}
    written = 0
    for outcome in outcomes:
        arrived[position[outcome.plan.region.index]] = outcome
        while written in arrived:
            done = arrived.pop(written)
            written += 1
            with progress(label(written, todo[written - 1])) as (slog, _):
                for line in done.result.log_lines:
                    slog.emit(line)
        yield outcome


#: seconds of runs that time a layer stack's composite plan and its unfused plan, each: no decision rests on these
#: figures (each distinct region's plan was chosen by its search), and a whole model's call is long and steady
#: enough that a few runs report it (BERT-base padded, 70 ms a call: 9 runs each were 1.3 s of a 12 s plan)
COMPOSITE_TIMING_S = 0.2
COMPOSITE_MIN_RUNS = 3


def measure_composite(mp: ModelPlan, backend: Backend, opts: SearchOptions,
                      inputs: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """On a measuring backend: verify the whole composite plan against the reference, then time it
    and the unfused plan, on ``inputs`` (a module's own values; default: the input recipe).  Otherwise nothing
    more runs: every region's plan was verified by its search, and the composite is those plans renamed
    (executing a deep model at full size in numpy would cost far more than planning it)."""
    out: dict[str, Any] = {"verified": "per region", "meas_us": None, "unfused_meas_us": None,
                           "speedup_vs_unfused": None}
    if not backend.measures:
        return out
    inputs = inputs if inputs is not None else random_inputs(mp.graph, opts.seed)
    expected = execute_graph(mp.graph, inputs)
    compiled = backend.compile(mp.plan)
    outs = compiled.run(inputs)
    problem, _, _ = check_outputs(mp.plan, outs, expected, opts.rtol, opts.atol)
    if problem is not None and problem.startswith("tolerance"):  # the fp64 allowance, computed on demand (as the
        # search does: a whole model in fp64 took 1-2 s of a cold plan)
        oracle = execute_graph(mp.graph, inputs, "oracle")
        problem, _, _ = check_outputs(mp.plan, outs, expected, opts.rtol, opts.atol, oracle)
    if problem:
        raise SearchError(f"the composite plan does not match the reference: {problem}")
    best = _reported_us(compiled, inputs, opts)  # its check's run was its first warm-up
    del compiled
    base = _reported_us(backend.compile(mp.unfused), inputs, opts)
    out.update(verified="whole graph", meas_us=best, unfused_meas_us=base, speedup_vs_unfused=base / best)
    return out


def _reported_us(compiled: CompiledPlan, inputs: Mapping[str, np.ndarray], opts: SearchOptions) -> float:
    """The median time of a whole model's plan, for the report: one warm-up, then at least
    :data:`COMPOSITE_MIN_RUNS` runs and more (up to ``opts.repeats``) while they fit :data:`COMPOSITE_TIMING_S`."""
    runs = 0

    def enough(median_us: float) -> bool:
        nonlocal runs
        runs += 1
        return runs >= COMPOSITE_MIN_RUNS and runs * median_us >= COMPOSITE_TIMING_S * 1e6

    return compiled.time(inputs, warmup=min(1, opts.warmup), repeats=opts.repeats, stop_if=enough).median_us

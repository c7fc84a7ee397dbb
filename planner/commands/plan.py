"""``fusion-planner plan``: search candidate plans on a backend, verify and time them, keep the fastest."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from planner.cluster.pool import DEFAULT_GRACE_S, DEFAULT_KEEP_S, EXECUTORS, ExecutorOptions
from planner.commands.common import (
    add_graph_args,
    add_planning_args,
    add_threads_arg,
    emit_json,
    graph_from_args,
    limits_from_args,
)
from planner.core import limits
from planner.core.cost import DeviceSpec
from planner.core.errors import UsageError
from planner.core.graph import Graph
from planner.core.kinds import Verdict
from planner.core.planfile import save_plan
from planner.core.plans import Plan
from planner.core.report import TABLE_WIDTH, count_text, kernels_text, ledger_table, plan_title, region_title
from planner.model.plancache import PlanCache
from planner.model.stack import ModelPlan
from planner.pipeline import Planned, PlanOptions, plan_graph
from planner.registry import backend_names, device_for, get_backend
from planner.rules.load import load_rules
from planner.search.engine import SearchError
from planner.search.plots import write_plots
from planner.search.results import SearchOptions, SearchResult
from planner.search.searchlog import SearchLog, env_flag, fmt_us


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="search candidate plans on a backend: verify, time, keep the fastest",
        description=(
            "Build candidates as explain does, then compile, verify against the numpy reference and time them "
            "on a backend (docs/search.md). SEARCH_LOG=1 or --search-log prints the search log on stderr."
        ),
    )
    add_graph_args(p)
    add_planning_args(p)
    add_search_args(p)
    p.set_defaults(handler=run)


def add_search_args(p: argparse.ArgumentParser) -> None:
    d = SearchOptions()
    g = p.add_argument_group("search")
    g.add_argument("--backend", default="model", help=f"one of {', '.join(backend_names())} (default model)")
    add_threads_arg(g)
    g.add_argument("--max-candidates", type=int, default=d.max_candidates, help="candidates besides the unfused baseline")
    g.add_argument("--time-budget", type=float, default=d.time_budget_s, metavar="SECONDS", help="wall-time budget")
    g.add_argument("--early-stop", type=float, default=d.early_stop, help="stop timing above best x this factor")
    g.add_argument("--warmup", type=int, default=d.warmup, help="untimed runs per candidate")
    g.add_argument("--repeats", type=int, default=d.repeats, help="timed runs per candidate (median)")
    g.add_argument("--max-rounds", type=int, default=d.max_rounds, metavar="N",
                   help="interleaved rounds that may compare a candidate within the noise with the best (at least 8)")
    g.add_argument("--patience", type=int, default=d.patience, metavar="N",
                   help="end the genetic phase after N candidates in a row without a faster plan (0: never)")
    g.add_argument("--confidence", type=float, default=d.confidence,
                   help="confidence that separates two timings in those rounds (else a tie: the cost model's choice)")
    g.add_argument("--rtol", type=float, default=None, help="override the dtype's relative tolerance")
    g.add_argument("--atol", type=float, default=None, help="override the dtype's absolute tolerance")
    g.add_argument("--search-log", action="store_true", help="print the search log on stderr (as SEARCH_LOG=1)")
    g.add_argument("--out", metavar="DIR", help="write plan.json, results.json and three PNG plots here (fusion-planner plot redraws them)")
    g.add_argument("--measured", metavar="MEASURED.json",
                   help="merge results timed elsewhere (python -m backends.cupy time) instead of running here "
                        "(the measured backend)")
    g.add_argument("--no-dedup", action="store_true", help="search the whole graph even when regions repeat")
    g.add_argument("--by-region", action="store_true",
                   help="plan region by region even where no region repeats: each distinct region its own e-graph and "
                        "search (what --executor ray always does; docs/scaling.md)")
    g.add_argument("--no-cache", action="store_true", help="neither read nor write the plan cache")
    g.add_argument("--cache-dir", help="plan cache folder (default $FUSION_PLANNER_PLAN_CACHE, else $XDG_CACHE_HOME/fusion-planner/plans)")
    c = p.add_argument_group("executor (docs/scaling.md, \"Many machines\")")
    c.add_argument("--executor", choices=EXECUTORS, default="serial",
                   help="serial: search the regions here, one after another; ray: fan the distinct regions out over "
                        "the workers of a Ray cluster, one device each (pip install 'fusion-planner[ray]')")
    c.add_argument("--workers", type=limits.positive_arg, default=None, metavar="N",
                   help="ray: start a local cluster of N workers (default: this machine's cores over --threads, "
                        "which is 1 per worker unless given)")
    c.add_argument("--ray-address", metavar="ADDR", help="ray: join this running cluster (ray start --head) instead")
    c.add_argument("--worker-grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="ray: a worker still searching a region this long after its budget ran out is taken for "
                        "hung, killed and replaced (default %(default)g)")
    c.add_argument("--keep-workers", type=float, default=None, metavar="SECONDS",
                   help="ray: keep the workers this long for the next search on a cluster this command did not start "
                        f"(the next search takes them warm; default {DEFAULT_KEEP_S:g} with --ray-address; 0: end "
                        "them with the search)")


def options_from_args(args: argparse.Namespace) -> SearchOptions:
    opts = SearchOptions(
        max_candidates=args.max_candidates,
        time_budget_s=args.time_budget,
        early_stop=args.early_stop,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        rtol=args.rtol,
        atol=args.atol,
        max_rounds=args.max_rounds,
        confidence=args.confidence,
        patience=args.patience,
    )
    opts.validate()
    return opts


def executor_from_args(args: argparse.Namespace) -> ExecutorOptions:
    if args.measured and args.executor != "serial":
        raise UsageError("--measured merges results timed elsewhere: there is nothing to fan out (--executor serial)")
    ex = ExecutorOptions(args.executor, args.workers, args.ray_address, args.worker_grace, args.keep_workers)
    ex.validate()
    return ex


def run(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    executor = executor_from_args(args)
    graph = graph_from_args(args)
    spec = device_for(args.device, "measured" if args.measured else args.backend)
    backend_options = {"threads": executor.threads(args.backend, args.threads)}
    if args.measured:
        backend = get_backend("measured", spec, source=args.measured, **backend_options)
    else:
        backend = get_backend(args.backend, spec, **backend_options)
    backend.fits(graph)
    out_dir = _out_dir(args.out)
    options = PlanOptions(args.backend, spec, tuple(load_rules(args.rules)), limits_from_args(args), args.cap,
                          args.top, opts, dedup=not args.no_dedup and not args.measured, executor=executor,
                          by_region=args.by_region, backend_options=backend_options)
    # remote results answer for exactly the exported candidates: never from or into the cache
    cache = None if args.no_cache or args.measured else PlanCache(args.cache_dir, read=not _wants_search_evidence(args))
    try:
        planned = plan_graph(graph, options, backend, cache=cache, progress=lambda label: _progress(args.search_log, label))
    except SearchError as exc:
        print(f"fusion-planner plan: search failed: {exc}", file=sys.stderr)
        return 1
    if planned.model is not None:
        return report_regions(args, planned, out_dir)
    if planned.from_cache:
        return report_cached(args, planned, out_dir)
    result = planned.search
    assert result is not None and planned.candidates is not None
    if out_dir is not None:
        written = write_outputs(out_dir, result, planned.candidates.graph, spec)
    if args.json:
        emit_json(dict(result.to_json(), executor=planned.executor_notes) if planned.executor_notes else result.to_json())
    else:
        print_result(result, args.all_rows)
        for note in planned.executor_notes:
            print(f"executor: {note}")
        if out_dir is not None:
            print("wrote " + ", ".join(str(p) for p in written))
    return 130 if result.interrupted else 0  # the shell's code for Ctrl-C, after the best so far


def _wants_search_evidence(args: argparse.Namespace) -> bool:
    """--out and the search log report the search itself (results, plots, the log); a cached
    choice has none of that, so such a run searches again (and refreshes the cache entry).
    --json of a cached choice says so ("from_cache": true) and holds the plan, not a candidate list."""
    return bool(args.out or args.search_log or env_flag("SEARCH_LOG"))


def _out_dir(path: str | None) -> Path | None:
    if path is None:
        return None
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--out {path}: exists and is not a directory")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--out writes plots and needs matplotlib (pip install 'fusion-planner[plots]')") from None
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".fusion-planner-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--out {path}: cannot write there ({exc.strerror or exc})") from None
    return p


@contextlib.contextmanager
def _progress(force_log: bool, label: str) -> Iterator[tuple[SearchLog, Callable[[int, int], None] | None]]:
    """A rich progress bar on a terminal only, naming what is searched (``label``) and counting its candidates
    against the search's total; log lines go through its console then."""
    enabled = True if force_log else None
    if not sys.stderr.isatty():
        yield SearchLog(enabled=enabled), None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (TextColumn("search {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield SearchLog(enabled=enabled, write=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True)), tick


def print_result(result: SearchResult, full: bool = False) -> None:
    scope = "enumerated" if result.enumerated else "sampled"
    estimated = not result.measures and bool(result.timed)  # the model backend: every figure is an estimate
    print(
        f"{result.graph} on {result.device}, backend {result.backend}: {count_text(result.space)} candidate plans ({scope}); "
        f"{len(result.timed)} {'costed' if estimated else 'timed'}, {len(result.rejected)} rejected"
        + (f", {len(result.bounded)} slower by their kernels" if result.bounded else "")
        + (f", {len(result.predicted)} not faster by their kernels" if result.predicted else "")
        + f" in {result.elapsed_s:.2f}s ({result.stop})"
    )
    if result.verification:
        print(f"verification: {result.verification}")
    meas = {e.plan.key: e for e in result.entries}

    def meas_col(p: Plan) -> str:
        e = meas[p.key]
        if e.meas_us is None:
            return "-"
        return f"{e.meas_us:,.2f}" + ("+" if e.stopped_early else "")

    def verdict_col(p: Plan) -> str:
        v = meas[p.key].verdict_text
        v = "costed" if estimated and v == "timed" else v
        return v if full or len(v) <= 24 else v[:21] + "..."

    tried = [e.plan for e in result.entries if e.verdict != Verdict.NOT_TIMED or e.verified]
    extra = [("verdict", verdict_col)] if estimated else [("meas_us", meas_col), ("verdict", verdict_col)]
    print(ledger_table(tried, result.best.key, extra=extra, full=full))
    untried = len(result.entries) - len(tried)
    if untried:
        print(f"({untried:,} more candidates of the cost-model list were not tried; --json and results.json list them)")
    b = result.best_entry
    best_meas = fmt_us(b.meas_us) if b.meas_us is not None else f"not timed (backend {result.backend} only verifies)"
    print(f"best: {plan_title(b.plan)}  est {fmt_us(b.est_us)}"
          + ("" if estimated else f"  meas {best_meas}"))
    if result.speedup_vs_unfused is not None:
        how = ", estimated" if estimated else ""
        print(f"speedup vs unfused (one kernel per op{how}): {result.speedup_vs_unfused:.2f}x")
    if estimated:
        print(f"note: backend {result.backend} does not measure: every figure is the cost model's estimate "
              "(--backend cpu measures)")
        return
    rho = "n/a" if result.spearman is None else f"{result.spearman:.2f}"
    print(f"spearman rho (estimated vs measured, {len(result.timed)} timed): {rho}")
    if not result.timed:
        print(f"note: backend {result.backend} only verifies; every candidate shown passed verification")


def write_outputs(out: Path, result: SearchResult, graph: Graph, spec: DeviceSpec) -> list[Path]:

    b = result.best_entry
    meta = {
        "backend": result.backend,
        "meas_us": b.meas_us,
        "speedup_vs_unfused": result.speedup_vs_unfused,
        "composition": b.plan.composition(),
    }
    doc = result.to_json()
    save_plan(out / "plan.json", result.best, graph, spec, meta)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    return [out / "plan.json", out / "results.json", *write_plots(doc, out)]


def report_cached(args: argparse.Namespace, planned: Planned, out_dir: Path | None) -> int:
    """A cached choice for this graph, device, backend, search options and rule set: no re-search."""
    graph, spec, full = planned.graph, planned.options.spec, planned.plan
    if args.json:
        emit_json({"graph": graph.name, "device": spec.name, "backend": args.backend, "from_cache": True,
                   "cache_key": planned.cache_key, "best": full.to_json()})
    else:
        print(f"{graph.name} on {spec.name}, backend {args.backend}: plan from the cache, not re-searched "
              "(--no-cache searches again)")
        print(ledger_table([full], full.key))
    if out_dir is not None:
        save_plan(out_dir / "plan.json", full, graph, spec, {"backend": args.backend, "from_cache": True})
    return 0


def report_regions(args: argparse.Namespace, planned: Planned, out_dir: Path | None) -> int:
    """A layer stack: each structurally unique region searched once (docs/scaling.md)."""
    mp, meas, results = planned.model, planned.composite, planned.region_searches
    assert mp is not None
    if args.json:
        emit_json(dict(mp.summary(), backend=args.backend, **meas, executor=planned.executor_notes,
                       best=mp.plan.to_json(),
                       region_plans=[region_json(u, results.get(u.region.graph.name)) for u in mp.unique.values()]))
    else:
        print_regions(mp, args.backend, meas)
        for note in planned.executor_notes:
            print(f"executor: {note}")
    if out_dir is not None:
        save_plan(out_dir / "plan.json", mp.plan, mp.graph, mp.spec, dict(backend=args.backend, **meas))
        (out_dir / "results.json").write_text(json.dumps({k: r.to_json() for k, r in results.items()}, indent=1) + "\n")
        written = [out_dir / "plan.json", out_dir / "results.json", *region_plots(out_dir, results)]
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


def region_plots(out: Path, results: dict[str, SearchResult]) -> list[Path]:
    """The plots of each searched region, named by its suffix: predicted_vs_measured.r0.png, ..."""
    return [p for name, result in results.items() for p in write_plots(result.to_json(), out, name.rsplit(".", 1)[-1])]


def region_json(u, searched: SearchResult | None = None) -> dict:
    """A distinct region's plan; where it was searched in this run, the search's figures too."""
    doc = {"key": u.key, "instances": u.instances, "from_cache": u.cached, "ops": len(u.region.ops),
           "plan": u.plan.to_json()}
    if searched is not None:
        doc.update(meas_us=searched.best_entry.meas_us, speedup_vs_unfused=searched.speedup_vs_unfused,
                   search_s=round(searched.elapsed_s, 4))
    return doc


#: distinct regions listed in the text report (a long graph's segments: --json lists all)
TABLE_REGIONS = 24


def print_regions(mp: ModelPlan, backend: str, meas: dict) -> None:
    s = mp.summary()
    print(f"{mp.graph.name} on {mp.spec.name}, backend {backend}: {s['ops']} ops in {s['regions']} regions, "
          f"{s['unique_regions']} unique ({s['cache_hits']} from the cache); planned in {s['times_s']['total']:.2f}s")
    for note in mp.notes:
        print(f"note: {note}")
    shown = list(mp.unique.values())[:TABLE_REGIONS]
    for u in shown:
        src = "cache" if u.cached else "searched"
        head = f"  region {region_title(u.region)} x{u.instances} ({len(u.region.ops)} ops, {src}): "
        tail = f"  est {fmt_us(u.plan.est_us)}"
        print(head + kernels_text(u.plan, max(24, TABLE_WIDTH - len(head) - len(tail))) + tail)
    if len(mp.unique) > len(shown):
        print(f"  ... {len(mp.unique) - len(shown):,} more regions (--json lists them)")
    p = mp.plan
    checked = ("the whole plan verified against the reference" if meas["verified"] == "whole graph"
               else "each region's plan verified against the reference when it was searched")
    print(f"composite: {len(p.kernels)} kernels, {p.bytes:,} bytes, est {fmt_us(p.est_us)} "
          f"(unfused est {fmt_us(mp.unfused.est_us)}); {checked}")
    if meas["meas_us"] is not None:
        print(f"measured: {fmt_us(meas['meas_us'])}, unfused {fmt_us(meas['unfused_meas_us'])}, "
              f"speedup {meas['speedup_vs_unfused']:.2f}x")

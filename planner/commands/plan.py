"""``fusion-planner plan``: search candidate plans on a backend, verify and time them, keep the fastest."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from backends import BACKENDS, get_backend
from planner.candidates import build_candidates, load_rules
from planner.cli import emit_json
from planner.commands.common import add_graph_args, add_planning_args, graph_from_args, limits_from_args
from planner.cost import DeviceSpec, load_device
from planner.errors import UsageError
from planner.graph import Graph
from planner.planfile import save_plan
from planner.plans import Plan
from planner.report import ledger_table
from planner.search import SearchError, SearchOptions, SearchResult, search
from planner.searchlog import SearchLog, fmt_us


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
    g.add_argument("--backend", default="model", help=f"one of {', '.join(BACKENDS)} (default model)")
    g.add_argument("--max-candidates", type=int, default=d.max_candidates, help="candidates besides the unfused baseline")
    g.add_argument("--time-budget", type=float, default=d.time_budget_s, metavar="SECONDS", help="wall-time budget")
    g.add_argument("--early-stop", type=float, default=d.early_stop, help="stop timing above best x this factor")
    g.add_argument("--warmup", type=int, default=d.warmup, help="untimed runs per candidate")
    g.add_argument("--repeats", type=int, default=d.repeats, help="timed runs per candidate (median)")
    g.add_argument("--rtol", type=float, default=None, help="override the dtype's relative tolerance")
    g.add_argument("--atol", type=float, default=None, help="override the dtype's absolute tolerance")
    g.add_argument("--search-log", action="store_true", help="print the search log on stderr (as SEARCH_LOG=1)")
    g.add_argument("--out", metavar="DIR", help="write plan.json, results.json and two PNG plots here")


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
    )
    opts.validate()
    return opts


def run(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    graph = graph_from_args(args)
    limits = limits_from_args(args)
    spec = load_device(args.device)
    backend = get_backend(args.backend, spec)
    out_dir = _out_dir(args.out)
    cands = build_candidates(graph, spec, rules=load_rules(args.rules), limits=limits, cap=args.cap, k=args.top, seed=args.seed)
    with _progress(args.search_log) as (slog, tick):
        try:
            result = search(cands, backend, options=opts, log=slog, on_candidate=tick)
        except SearchError as exc:
            print(f"fusion-planner plan: search failed: {exc}", file=sys.stderr)
            return 1
    if out_dir is not None:
        written = write_outputs(out_dir, result, cands.graph, spec)
    if args.json:
        emit_json(result.to_json())
    else:
        print_result(result)
        if out_dir is not None:
            print("wrote " + ", ".join(str(p) for p in written))
    return 0


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
    p.mkdir(parents=True, exist_ok=True)
    return p


@contextlib.contextmanager
def _progress(force_log: bool) -> Iterator[tuple[SearchLog, Callable[[int, int], None] | None]]:
    """A rich progress bar on a terminal only; log lines go through its console then."""
    enabled = True if force_log else None
    if not sys.stderr.isatty():
        yield SearchLog(enabled=enabled), None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("search"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("search", total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield SearchLog(enabled=enabled, write=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True)), tick


def print_result(result: SearchResult) -> None:
    scope = "enumerated" if result.enumerated else "sampled"
    print(
        f"{result.graph} on {result.device}, backend {result.backend}: {result.space:,} candidate plans ({scope}); "
        f"{len(result.timed)} timed, {len(result.rejected)} rejected in {result.elapsed_s:.2f}s ({result.stop})"
    )
    meas = {e.plan.key: e for e in result.entries}

    def meas_col(p: Plan) -> str:
        e = meas[p.key]
        if e.meas_us is None:
            return "-"
        return f"{e.meas_us:,.2f}" + ("+" if e.stopped_early else "")

    def verdict_col(p: Plan) -> str:
        v = meas[p.key].verdict
        return v if len(v) <= 48 else v[:45] + "..."

    tried = [e.plan for e in result.entries if e.verdict != "not timed" or e.verified]
    print(ledger_table(tried, result.best.key, extra=[("meas_us", meas_col), ("verdict", verdict_col)]))
    untried = len(result.entries) - len(tried)
    if untried:
        print(f"({untried:,} more candidates of the cost-model list were not tried; --json and results.json list them)")
    b = result.best_entry
    meas = fmt_us(b.meas_us) if b.meas_us is not None else f"not timed (backend {result.backend} only verifies)"
    print(f"best: {b.plan.notation()} {b.plan.composition()}  est {fmt_us(b.est_us)}  meas {meas}")
    if result.speedup_vs_unfused is not None:
        print(f"speedup vs unfused (one kernel per op): {result.speedup_vs_unfused:.2f}x")
    rho = "n/a" if result.spearman is None else f"{result.spearman:.2f}"
    print(f"spearman rho (estimated vs measured, {len(result.timed)} timed): {rho}")
    if not result.measures and result.timed:
        print(f"note: backend {result.backend} does not measure; 'meas_us' is its model estimate")
    elif not result.timed:
        print(f"note: backend {result.backend} only verifies; every candidate shown passed verification")


def write_outputs(out: Path, result: SearchResult, graph: Graph, spec: DeviceSpec) -> list[Path]:
    from planner.searchplots import plot_best_so_far, plot_predicted_vs_measured

    b = result.best_entry
    meta = {
        "backend": result.backend,
        "meas_us": b.meas_us,
        "speedup_vs_unfused": result.speedup_vs_unfused,
        "composition": b.plan.composition(),
    }
    paths = [out / "plan.json", out / "results.json", out / "predicted_vs_measured.png", out / "best_so_far.png"]
    save_plan(paths[0], result.best, graph, spec, meta)
    paths[1].write_text(json.dumps(result.to_json(), indent=1) + "\n")
    plot_predicted_vs_measured(result, paths[2])
    plot_best_so_far(result, paths[3])
    return paths

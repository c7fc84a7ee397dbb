"""``fusion-planner plot RESULTS.json``: draw a search's plots from the results file ``plan --out`` wrote."""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.commands.common import emit_json
from planner.core.errors import UsageError
from planner.search.plots import FORMATS, PLOTS, load_results, write_plots


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot", help="draw a search's plots from the results.json that 'plan --out' wrote",
        description=(f"Draw {', '.join(PLOTS)} for each search in RESULTS.json (a layer stack: one set per region, "
                     "named by its suffix): estimated vs measured time, the Pareto front of DRAM bytes, launches and "
                     "register peak, and the best plan so far over the search's time."),
    )
    p.add_argument("results", metavar="RESULTS.json", help="results.json written by 'fusion-planner plan --out DIR'")
    p.add_argument("--out", metavar="DIR", help="write the plots here (default: the results file's folder)")
    p.add_argument("--format", choices=FORMATS, default="png", help="image format (default png)")
    p.add_argument("--json", action="store_true", help="print the written paths as one JSON object")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    searches = load_results(args.results)
    out = Path(args.out) if args.out else Path(args.results).resolve().parent
    if not out.is_dir():
        raise UsageError(f"--out {out}: no such folder")
    written = [p for name, doc in searches.items() for p in write_plots(doc, out, name.rsplit(".", 1)[-1], args.format)]
    if args.json:
        emit_json({"written": [str(p) for p in written]})
    else:
        print("wrote " + ", ".join(str(p) for p in written))
    return 0

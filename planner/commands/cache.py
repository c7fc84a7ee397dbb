"""``fusion-planner cache clear``: drop every cached region plan."""

from __future__ import annotations

import argparse

from planner.plancache import PlanCache


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="manage the on-disk plan cache", description="Manage the on-disk plan cache.")
    p.add_argument("action", choices=["clear", "path"], help="clear: delete all entries; path: print the cache folder")
    p.add_argument("--cache-dir", help="cache folder (default: $XDG_CACHE_HOME/fusion-planner/plans)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cache = PlanCache(args.cache_dir)
    if args.action == "path":
        print(cache.root)
        return 0
    n = cache.clear()
    print(f"removed {n} cached plan(s) from {cache.root}")
    return 0

"""``fusion-planner cache clear``: drop the cached region plans (and nothing else)."""

from __future__ import annotations

import argparse

from planner.model.plancache import PlanCache


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="manage the on-disk plan cache", description="Manage the on-disk plan cache.")
    p.add_argument(
        "action", choices=["clear", "path"],
        help="clear: delete the entries the cache wrote (refused if the folder holds anything else); "
        "path: print the cache folder",
    )
    p.add_argument("--cache-dir", help="cache folder (default: $XDG_CACHE_HOME/fusion-planner/plans)")
    p.add_argument("--force", action="store_true",
                   help="clear even when the folder holds other files: they are left alone, only entries are removed")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    cache = PlanCache(args.cache_dir)
    if args.action == "path":
        print(cache.root)
        return 0
    n = cache.clear(force=args.force)
    print(f"removed {n} cached plan(s) from {cache.root}")
    return 0

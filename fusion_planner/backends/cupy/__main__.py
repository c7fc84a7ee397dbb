"""The remote runner (no egglog needed).

``python -m fusion_planner.backends.cupy time cands.json -o measured.json [--executor numpy|cupy]``
``python -m fusion_planner.backends.cupy c05 c05.json [-o result.json]``
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from fusion_planner.backends.cupy import c05
from fusion_planner.backends.cupy.bundle import BundleError, load_bundle
from fusion_planner.backends.cupy.runner import best_timed, make_executor, time_bundle, write_measured
from fusion_planner.core.kinds import Verdict


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fusion_planner.backends.cupy", description="Verify and time exported candidates.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("time", help="verify every candidate against the numpy reference, then time it")
    t.add_argument("bundle", help="candidates JSON from `fusion-planner export-candidates`")
    t.add_argument("-o", "--output", required=True, help="measured-results JSON to write")
    t.add_argument("--executor", choices=["numpy", "cupy"], default="cupy", help="where to run (default cupy)")
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--repeats", type=int, default=7)
    t.add_argument("--max-candidates", type=int, default=None, help="time only the first N candidates")
    t.add_argument("-q", "--quiet", action="store_true", help="no per-candidate log lines")
    c = sub.add_parser("c05", help="seed C-05 tables from `fusion-planner bench c05 --export` (GPU timing)")
    c.add_argument("bundle", help="C-05 bundle JSON")
    c.add_argument("-o", "--output", help="also write the result JSON here")
    c.add_argument("--warmup", type=int, default=2)
    c.add_argument("--repeats", type=int, default=7)
    return p


def run_c05(args: argparse.Namespace) -> int:


    try:
        data = c05.load_c05(args.bundle)
    except (ValueError, OSError) as exc:
        print(f"python -m fusion_planner.backends.cupy c05: error: {exc}", file=sys.stderr)
        return 2
    result = c05.run_bundle(c05.bundle_variants(data), data, c05.gpu_executor(), args.warmup, args.repeats)
    c05.print_result(result)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "c05":
        return run_c05(args)
    if args.warmup < 0 or args.repeats < 1:
        print("python -m fusion_planner.backends.cupy time: error: --warmup must be >= 0 and --repeats >= 1", file=sys.stderr)
        return 2
    try:
        bundle = load_bundle(args.bundle)
    except (BundleError, OSError) as exc:
        print(f"python -m fusion_planner.backends.cupy time: error: {exc}", file=sys.stderr)
        return 2
    executor = make_executor(args.executor)
    result = time_bundle(
        bundle,
        executor,
        warmup=args.warmup,
        repeats=args.repeats,
        max_candidates=args.max_candidates,
        progress=None if args.quiet else print,
    )
    write_measured(result, args.output)
    best = best_timed(result)
    n_ok = sum(1 for c in result["candidates"] if c["verdict"] == Verdict.TIMED)
    print(f"{bundle.graph}: {n_ok}/{len(result['candidates'])} candidates verified and timed on {args.executor}")
    if best is not None:
        print(f"best: {best['plan']} {best['composition']}  {best['meas_us']:.2f} us")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

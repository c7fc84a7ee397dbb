"""``fusion-planner calibrate``: measure a device with a backend and write a DeviceSpec file.

The backends contribute the calibrations (``BackendPlugin.calibration``): the cpu backend measures this
machine; the cupy backend turns a file measured on a GPU machine into a spec."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from planner.backend import Calibration
from planner.core.errors import UsageError
from planner.registry import plugins


def _calibrations() -> dict[str, Calibration]:
    return {name: p.calibration for name, p in plugins().items() if p.calibration is not None}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine; write a device spec for --device FILE",
        description=(
            "Microbenchmarks (triad bandwidth, empty-kernel overhead, GEMM FLOP/s at three sizes, "
            "vector FLOP/s) on the chosen backend, written as a DeviceSpec JSON file."
        ),
    )
    found = _calibrations()
    p.add_argument("--backend", default="cpu", help=f"backend to measure with ({', '.join(found)})")
    p.add_argument("-o", "--output", metavar="FILE", help="write the spec here (default: print it)")
    p.add_argument("--name", help="the spec's name (default cpu-calibrated, or BASE-measured)")
    for cal in found.values():
        cal.add_args(p)
    p.set_defaults(handler=run)


def _chosen(args: argparse.Namespace) -> Calibration:
    found = _calibrations()
    for cal in found.values():
        if cal.selected_by is not None and getattr(args, cal.selected_by, None) is not None:
            return cal
    if args.backend not in found:
        raise UsageError(f"calibrate: backend {args.backend!r} cannot be calibrated; choose one of {', '.join(found)}")
    return found[args.backend]


def run(args: argparse.Namespace) -> int:
    out = Path(args.output) if args.output else None
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise UsageError(f"calibrate: cannot write {args.output}: " + ("it is a folder" if out.is_dir() else "no such folder"))
    spec, line = _chosen(args).run(args)
    print(line, file=sys.stderr)
    text = json.dumps(spec.to_json(), indent=1) + "\n"
    if out is not None:
        try:
            out.write_text(text)
        except OSError as exc:
            raise UsageError(f"calibrate: cannot write {args.output}: {exc.strerror}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0

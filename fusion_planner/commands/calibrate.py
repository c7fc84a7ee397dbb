"""``fusion-planner calibrate``: measure this machine and write a DeviceSpec file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fusion_planner.backends.base import BackendUnavailable
from fusion_planner.backends.cpu.calibrate import calibrate_cpu
from fusion_planner.backends.cpu.codegen import CompilerUnavailable
from fusion_planner.backends.cupy.calibrate import load_measured_file, spec_from_measured
from fusion_planner.core.cost import DeviceSpec, DeviceSpecError, load_device
from fusion_planner.core.errors import UsageError

#: backends that can be calibrated
CALIBRATABLE = ("cpu",)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine; write a device spec for --device FILE",
        description=(
            "Microbenchmarks (triad bandwidth, empty-kernel overhead, GEMM FLOP/s at three sizes, "
            "vector FLOP/s) on the chosen backend, written as a DeviceSpec JSON file."
        ),
    )
    p.add_argument("--backend", default="cpu", help=f"backend to measure ({', '.join(CALIBRATABLE)})")
    p.add_argument("-o", "--output", metavar="FILE", help="write the spec here (default: print it)")
    p.add_argument("--name", help="the spec's name (default cpu-calibrated, or BASE-measured)")
    p.add_argument("--from-measured", metavar="FILE",
                   help="no measuring here: turn a GPU calibration file (python -m fusion_planner.backends.cupy "
                        "calibrate, on the device) into a spec")
    p.add_argument("--base", default="h200", help="with --from-measured: the spec whose peaks and limits are kept")
    p.set_defaults(handler=run)


def from_measured(args: argparse.Namespace) -> DeviceSpec:
    try:
        return spec_from_measured(load_measured_file(args.from_measured), load_device(args.base),
                                  args.from_measured, args.name)
    except DeviceSpecError as exc:
        raise UsageError(f"calibrate: {exc}") from None


def run(args: argparse.Namespace) -> int:
    if args.backend not in CALIBRATABLE:
        raise UsageError(f"calibrate: backend {args.backend!r} cannot be calibrated; choose one of {', '.join(CALIBRATABLE)}")
    out = Path(args.output) if args.output else None
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise UsageError(f"calibrate: cannot write {args.output}: " + ("it is a folder" if out.is_dir() else "no such folder"))

    if args.from_measured:
        spec = from_measured(args)
        print(f"{spec.name}: {spec.bandwidth_gbps:.0f} GB/s, launch {spec.launch_us:.2f} us, {spec.sm_count} SMs, "
              f"cuBLASLt efficiency {spec.gemm_efficiency['cublaslt']:.2f} ({spec.source})", file=sys.stderr)
    else:
        try:
            cal = calibrate_cpu()
        except (CompilerUnavailable, BackendUnavailable) as exc:
            raise UsageError(f"calibrate: {exc}") from None
        spec = cal.spec(args.name or "cpu-calibrated")
        gemm = "  ".join(f"{n}^3 {g:.1f}" for n, g in cal.gemm_gflops.items())
        print(
            f"triad {cal.triad_gbps:.2f} GB/s | empty kernel {cal.launch_us:.3f} us | GEMM GFLOP/s {gemm} "
            f"(row-tiled {cal.tiled_gemm_gflops:.1f}) | vector {cal.vector_gflops:.2f} GFLOP/s | {cal.seconds:.1f} s",
            file=sys.stderr,
        )
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

"""The remote runner (no egglog needed).

``python -m backends.cupy time cands.json -o measured.json [--executor numpy|cupy]``
``python -m backends.cupy c05 c05.json [-o result.json]``
``python -m backends.cupy nvrtc BUNDLE... [--nvcc] [--out kernels.md]`` (no GPU needed)
``python -m backends.cupy calibrate -o calibration.json`` (``fusion-planner calibrate --from-measured``)
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backends.cupy import c05, calibrate, facts
from backends.cupy.bundle import BundleError, generated_kernels, load_bundle
from backends.cupy.kernel import CudaKernel
from backends.cupy.runner import best_timed, make_executor, time_bundle, write_measured
from planner.backend import BackendUnavailable
from planner.core import limits
from planner.core.errors import UsageError
from planner.core.kinds import Verdict


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m backends.cupy", description="Verify and time exported candidates.")
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
    n = sub.add_parser("nvrtc", help="compile every kernel of the bundles as cupy does on the device (NVRTC, no GPU)")
    n.add_argument("bundles", nargs="+", help="candidates or C-05 bundle JSON files")
    n.add_argument("--nvcc", action="store_true", help="also compile with nvcc and compare registers and spills")
    n.add_argument("--out", help="write the per-kernel table (markdown) here")
    cal = sub.add_parser("calibrate", help="measure launch overhead, copy bandwidth and GEMM rates on this GPU")
    cal.add_argument("-o", "--output", required=True, help="calibration JSON to write")
    for command in (t, c, n):  # the same limits as every file the planner reads
        limits.add_flags(command)
    return p


def run_calibrate(args: argparse.Namespace) -> int:
    data = calibrate.measure()
    Path(args.output).write_text(json.dumps(data, indent=1) + "\n")
    gemm = ", ".join(f"{d} {max(t.values()):.0f}" for d, t in data["gemm_tflops"].items())
    print(f"{data['device']}: launch {data['launch_us']:.2f} us, copy {max(data['copy_gbps'].values()):.0f} GB/s, "
          f"GEMM TFLOP/s {gemm}; wrote {args.output}")
    return 0


def run_nvrtc(args: argparse.Namespace) -> int:
    from backends.cupy import nvrtc  # needs cupy (no GPU)

    prog = "python -m backends.cupy nvrtc"
    kernels: dict[str, CudaKernel] = {}
    for path in args.bundles:
        try:
            found = generated_kernels(path)
        except (BundleError, ValueError, KeyError, OSError) as exc:
            print(f"{prog}: error: {path}: {exc}", file=sys.stderr)
            return 2
        kernels.update((k.digest, k) for k in found)
        print(f"{path}: {len(found)} generated kernels")
    report = nvrtc.header_report()
    print(f"NVRTC {'.'.join(map(str, nvrtc.nvrtc_version()))}, {report.describe()}")
    results = nvrtc.compile_each(list(kernels.values()))
    failed = [(k, r) for k, r in zip(kernels.values(), results, strict=True) if isinstance(r, nvrtc.NvrtcError)]
    for _, err in failed:
        print(f"FAILED {err}")
    ok = [(k, r) for k, r in zip(kernels.values(), results, strict=True) if not isinstance(r, nvrtc.NvrtcError)]
    nvcc = facts.compile_many([k for k, _ in ok]) if args.nvcc and facts.nvcc_available() else [None] * len(ok)
    rows = [nvrtc.Comparison(k.name, r, n) for (k, r), n in zip(ok, nvcc, strict=True)]
    flagged = [r for r in rows if r.flagged]
    print(f"{len(ok)} of {len(kernels)} distinct kernels compiled under cupy's NVRTC options"
          + (f"; {len(flagged)} differ from nvcc by more than {nvrtc.REGS_TOLERANCE} registers or in spilling"
             if args.nvcc else ""))
    if args.out:
        Path(args.out).write_text(_nvrtc_page(args, nvrtc, report, rows, len(failed)))
        print(f"wrote {args.out}")
    return 1 if failed else 0


def _as_typed(paths: Sequence[str]) -> list[str]:
    """``dir/*.json`` for a folder whose every JSON file is in ``paths`` (what the shell expanded)."""
    out: list[str] = []
    for folder in dict.fromkeys(str(Path(p).parent) for p in paths):
        given = sorted(p for p in paths if str(Path(p).parent) == folder)
        every = sorted(str(p) for p in Path(folder).glob("*.json"))
        out += [f"{folder}/*.json"] if given == every else given
    return out


def _nvrtc_page(args: argparse.Namespace, nvrtc: Any, report: Any, rows: list[Any], failed: int) -> str:
    import cupy  # optional dependency: present, nvrtc imported it

    flagged = sum(r.flagged for r in rows)
    head = [
        "# Generated kernels under cupy's NVRTC options, registers beside nvcc's",
        "",
        f"Command: `python -m backends.cupy nvrtc {' '.join(_as_typed(args.bundles))}"
        f"{' --nvcc' if args.nvcc else ''} --out {args.out}`  ",
        f"Date: {datetime.date.today().isoformat()}; machine: {platform.machine()} (no GPU needed)  ",
        f"cupy {cupy.__version__}, NVRTC {'.'.join(map(str, nvrtc.nvrtc_version()))}"
        f"{', ' + facts.nvcc_version() if args.nvcc and facts.nvcc_available() else ''}  ",
        f"Options: `{' '.join(nvrtc.nvrtc_options())}`  ",
        f"Headers: {report.describe()}",
        "",
        f"{len(rows)} distinct kernels compiled, {failed} rejected; {flagged} flagged (registers more than "
        f"{nvrtc.REGS_TOLERANCE} apart, or only one compiler spilling).",
        "",
        "",
    ]
    # the paths of this machine's environment, not of the project, are noise on the page
    return "\n".join(head).replace(sys.prefix, "$VENV") + nvrtc.comparison_table(rows) + "\n"


def run_c05(args: argparse.Namespace) -> int:


    try:
        data = c05.load_c05(args.bundle)
        variants = c05.bundle_variants(data)
    except (ValueError, OSError) as exc:
        print(f"python -m backends.cupy c05: error: {exc}", file=sys.stderr)
        return 2
    result = c05.run_bundle(variants, data, c05.gpu_executor(), args.warmup, args.repeats)
    c05.print_result(result)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with limits.input_limits(limits.from_flags(args)):
            return _run(args)
    except (BackendUnavailable, UsageError) as exc:  # this machine cannot run the command at all, or a bad $limit
        print(f"python -m backends.cupy {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "c05":
        return run_c05(args)
    if args.command == "nvrtc":
        return run_nvrtc(args)
    if args.command == "calibrate":
        return run_calibrate(args)
    if args.warmup < 0 or args.repeats < 1:
        print("python -m backends.cupy time: error: --warmup must be >= 0 and --repeats >= 1", file=sys.stderr)
        return 2
    try:
        bundle = load_bundle(args.bundle)
    except (BundleError, OSError) as exc:
        print(f"python -m backends.cupy time: error: {exc}", file=sys.stderr)
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

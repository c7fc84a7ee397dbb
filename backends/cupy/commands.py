"""What the cupy backend adds to the command line: ``export-candidates``, ``bench c05``, the ``explain
--kernel-facts`` column and ``calibrate --from-measured``.

``bench c05`` reproduces seed 001 (C-05): a chain of stages (stage s: ``y = a_s*y + b_s``, ReLU on even s)
fused and unfused; its naive plan (one kernel per stage), fused plan (one kernel) and fat plan (fused plus
the register probe) come from the candidate set.  Without a GPU only the offline part is printed:
registers and spills from ``nvcc -arch=sm_90 --resource-usage`` and occupancy from the device spec.  On a GPU
(in-process, or through ``--export`` and ``python -m backends.cupy c05`` where egglog is missing) the seed's
two tables are measured; see :mod:`backends.cupy.c05`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from backends.cupy import c05
from backends.cupy.bundle import write_bundle
from backends.cupy.calibrate import load_measured_file, spec_from_measured
from backends.cupy.codegen import generate
from backends.cupy.facts import ARCH, annotate_candidates, compile_resources, facts_column, nvcc_available, occupancy
from planner.backend import Calibration, Candidates, ExplainColumn, Planning, PluginCommand
from planner.core.cost import DeviceSpec, DeviceSpecError, load_device
from planner.core.errors import UsageError
from planner.core.examples import ew_chain
from planner.core.plans import Plan

# ---------------------------------------------------------------- export-candidates


def register_export(sub: argparse._SubParsersAction, planning: Planning) -> None:
    p = sub.add_parser(
        "export-candidates",
        help="write candidates with CUDA sources and cuBLASLt calls for `python -m backends.cupy time`",
        description=(
            "Plan a graph and write every candidate self-contained: kernel bodies, generated CUDA sources, "
            "cuBLASLt calls, shapes, dtypes, input seed and the reference recipe (docs/gpu.md)."
        ),
    )
    planning.add_graph_args(p)
    planning.add_planning_args(p)
    p.add_argument("-o", "--output", required=True, metavar="CANDS.json", help="bundle to write")
    p.add_argument("--input-seed", type=int, default=0, help="seed of the random inputs the runner draws")
    p.add_argument("--kernel-facts", action="store_true", help="attach nvcc sm_90 regs/spills/occupancy to each kernel")
    p.set_defaults(handler=lambda args: export(args, planning))


def export(args: argparse.Namespace, planning: Planning) -> int:
    graph = planning.graph(args)
    cands = planning.candidates(args, graph)
    if args.kernel_facts:
        kernel_facts(cands)
    data = write_bundle(cands, args.output, seed=args.input_seed)
    n_cuda = sum(1 for c in data["candidates"] for k in c["kernels"] if "cuda" in k)
    n_lt = sum(1 for c in data["candidates"] for k in c["kernels"] if "cublaslt" in k)
    print(f"{graph.name}: wrote {len(data['candidates'])} candidates ({n_cuda} generated kernels, "
          f"{n_lt} cuBLASLt calls) to {args.output}")
    return 0


def kernel_facts(cands: Candidates) -> None:
    """nvcc's registers, spills and occupancy on each generated kernel of the candidates (sm_90)."""
    if not nvcc_available():
        raise UsageError("--kernel-facts needs nvcc on PATH")
    annotate_candidates(cands)


KERNEL_FACTS = ExplainColumn(
    "--kernel-facts", "compile generated kernels with nvcc (sm_90) and show regs/spill bytes/occupancy per kernel",
    "regs/spill/blk", kernel_facts, facts_column)

# ---------------------------------------------------------------- bench c05


def register_bench(sub: argparse._SubParsersAction, planning: Planning) -> None:
    p = sub.add_parser("bench", help="reproduce a seed benchmark with the planner's own kernels (c05)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("which", choices=["c05"], help="the benchmark (seed 001, C-05)")
    p.add_argument("--mode", choices=["sweep", "modes"], default="sweep", help="k sweep, or naive/fused/fat at k=4")
    p.add_argument("--n", type=int, default=2**24, help="elements (default 2^24)")
    p.add_argument("--block", type=int, default=256, help="threads per block (default 256)")
    p.add_argument("--ks", default="2,3,4,6,8", help="sweep: comma-separated stage counts")
    p.add_argument("--k", type=int, default=4, help="modes: stage count (default 4)")
    p.add_argument("--fat-temps", type=int, default=48, help="live temporaries of the fat probe (default 48)")
    p.add_argument("--device", default=None, help="device spec for occupancy and estimates (default h200)")
    p.add_argument("--offline", action="store_true", help="print only the nvcc/device-spec part, even on a GPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--export", metavar="C05.json", help="write the plans for `python -m backends.cupy c05` and stop")
    p.set_defaults(handler=lambda args: bench(args, planning))


@dataclasses.dataclass(frozen=True)
class Variant:
    tag: str
    k: int
    plan: Plan


def stage_partition(k: int) -> tuple[int, ...]:
    """One kernel per seed stage: Affine+Relu on even s, Affine alone on odd s."""
    return tuple(2 if s % 2 == 0 else 1 for s in range(k))


def chain_variants(planning: Planning, k: int, n: int, spec: DeviceSpec, fat_temps: int,
                   with_fat: bool) -> list[Variant]:
    cands = planning.candidates_of(ew_chain(k, n, "fp32"), spec, cap=2 ** (k + (k + 1) // 2))
    by_part = {p.partition: p for p in cands.plans}
    naive_part, fused_part = stage_partition(k), (sum(stage_partition(k)),)
    missing = [p for p in (naive_part, fused_part) if p not in by_part]
    if missing:
        raise UsageError(f"k={k}: the candidate set lacks partition(s) {missing}; raise --cap")
    out = [Variant("naive", k, by_part[naive_part]), Variant("fused", k, by_part[fused_part])]
    if with_fat:
        fat = planning.candidates_of(ew_chain(k, n, "fp32", fat_temps=fat_temps), spec, cap=4096)
        one = [p for p in fat.plans if len(p.kernels) == 1]
        if not one:
            raise UsageError("the fat chain has no one-kernel plan among its candidates")
        out.append(Variant("fat", k, one[0]))
    return out


def offline_row(v: Variant, spec: DeviceSpec, block: int) -> dict[str, Any]:
    regs, spill, occ = [], [], []
    for k in v.plan.kernels:
        cuda = dataclasses.replace(generate(k, v.plan.tensors), block=block)
        res = compile_resources(cuda, ARCH)
        regs.append(res.regs)
        spill.append(res.spill_bytes)
        occ.append(occupancy(spec, res.regs, block, res.smem_bytes))
    return {"tag": v.tag, "k": v.k, "plan": v.plan.notation(), "kernels": len(v.plan.kernels), "regs_max": max(regs),
            "spill_bytes_max": max(spill), "blocks_per_sm_min": min(occ), "est_us": round(v.plan.est_us, 2),
            "bytes": v.plan.bytes}


def bench(args: argparse.Namespace, planning: Planning) -> int:
    spec = load_device(args.device)
    for name in ("n", "block", "k", "fat_temps", "repeats"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.block % 32 or args.block > 1024:
        raise UsageError(f"--block must be a multiple of 32 up to 1024, got {args.block}")
    try:
        ks = [int(x) for x in args.ks.split(",")] if args.mode == "sweep" else [args.k]
    except ValueError:
        raise UsageError(f"--ks must be comma-separated integers, got {args.ks!r}") from None
    if any(k < 1 or k > 10 for k in ks):
        raise UsageError("stage counts must be between 1 and 10")
    if not nvcc_available():
        raise UsageError("bench c05 needs nvcc on PATH: registers and spills come from nvcc -arch=sm_90 --resource-usage")
    variants = [v for k in ks for v in chain_variants(planning, k, args.n, spec, args.fat_temps, args.mode == "modes")]
    offline = [offline_row(v, spec, args.block) for v in variants]
    data = c05.c05_bundle([(v.tag, v.k, v.plan) for v in variants], args.mode, args.n, args.block, spec, offline)
    if args.export:
        c05.write_json(data, args.export)
        print(f"wrote C-05 {args.mode} bundle ({len(variants)} plans) to {args.export}; "
              f"on the GPU: python -m backends.cupy c05 {args.export}")
        return 0
    result = c05.run_bundle(c05.bundle_variants(data), data, None if args.offline else c05.gpu_executor(),
                            args.warmup, args.repeats)
    if args.json:
        planning.emit_json(result)
        return 0
    c05.print_result(result)
    return 0


COMMANDS = (PluginCommand("export-candidates", register_export), PluginCommand("bench", register_bench))

# ---------------------------------------------------------------- calibrate --from-measured


def _calibration_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from-measured", metavar="FILE",
                        help="no measuring here: turn a GPU calibration file (python -m backends.cupy calibrate, on "
                             "the device) into a spec")
    parser.add_argument("--base", default="h200", help="with --from-measured: the spec whose peaks and limits are kept")


def from_measured(args: argparse.Namespace) -> tuple[DeviceSpec, str]:
    if args.from_measured is None:
        raise UsageError("calibrate: backend 'cupy' cannot be calibrated from here: run `python -m backends.cupy "
                         "calibrate -o FILE` on the GPU machine, then `fusion-planner calibrate --from-measured FILE`")
    try:
        spec = spec_from_measured(load_measured_file(args.from_measured), load_device(args.base),
                                  args.from_measured, args.name)
    except DeviceSpecError as exc:
        raise UsageError(f"calibrate: {exc}") from None
    return spec, (f"{spec.name}: {spec.bandwidth_gbps:.0f} GB/s, launch {spec.launch_us:.2f} us, {spec.sm_count} SMs, "
                  f"cuBLASLt efficiency {spec.gemm_efficiency['cublaslt']:.2f} ({spec.source})")


FROM_MEASURED = Calibration(_calibration_args, from_measured, selected_by="from_measured")

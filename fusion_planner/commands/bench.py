"""``fusion-planner bench c05``: seed 001 (C-05) with the planner's own generated kernels.

Seed 001 ("C-05", the project's second design note) times a chain of stages
(stage s: ``y = a_s*y + b_s``, ReLU on even s) fused and unfused on an RTX 5090; the chain is built
as a graph; its naive plan (one kernel per stage), fused plan (one kernel) and
fat plan (fused plus the 48-temporary register probe) come from the candidate
set.  Without a GPU only the offline part is printed: registers and spills
from ``nvcc -arch=sm_90 --resource-usage`` and occupancy from the device spec.
On a GPU (in-process, or through ``--export`` and ``python -m fusion_planner.backends.cupy
c05`` where egglog is missing) the seed's two tables are measured; see
``fusion_planner/backends/cupy/c05.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from fusion_planner.backends.cupy import c05
from fusion_planner.backends.cupy.codegen import generate
from fusion_planner.backends.cupy.facts import ARCH, compile_resources, nvcc_available, occupancy
from fusion_planner.commands.common import emit_json
from fusion_planner.core.cost import DeviceSpec, load_device
from fusion_planner.core.errors import UsageError
from fusion_planner.core.examples import ew_chain
from fusion_planner.core.plans import Plan
from fusion_planner.egraph.candidates import build_candidates

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="reproduce a seed benchmark with the planner's own kernels (c05)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
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
    p.add_argument("--export", metavar="C05.json", help="write the plans for `python -m fusion_planner.backends.cupy c05` and stop")
    p.set_defaults(handler=run)


# ---------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True)
class Variant:
    tag: str
    k: int
    plan: Plan


def stage_partition(k: int) -> tuple[int, ...]:
    """One kernel per seed stage: Affine+Relu on even s, Affine alone on odd s."""
    return tuple(2 if s % 2 == 0 else 1 for s in range(k))


def chain_variants(k: int, n: int, spec: DeviceSpec, fat_temps: int, with_fat: bool) -> list[Variant]:

    cands = build_candidates(ew_chain(k, n, "fp32"), spec, cap=2 ** (k + (k + 1) // 2))
    by_part = {p.partition: p for p in cands.plans}
    naive_part, fused_part = stage_partition(k), (sum(stage_partition(k)),)
    missing = [p for p in (naive_part, fused_part) if p not in by_part]
    if missing:
        raise UsageError(f"k={k}: the candidate set lacks partition(s) {missing}; raise --cap")
    out = [Variant("naive", k, by_part[naive_part]), Variant("fused", k, by_part[fused_part])]
    if with_fat:
        fat = build_candidates(ew_chain(k, n, "fp32", fat_temps=fat_temps), spec)
        one = [p for p in fat.plans if len(p.kernels) == 1]
        if not one:
            raise UsageError("the fat chain has no one-kernel plan among its candidates")
        out.append(Variant("fat", k, one[0]))
    return out


# ---------------------------------------------------------------- offline facts


def offline_row(v: Variant, spec: DeviceSpec, block: int) -> dict[str, Any]:

    regs, spill, occ = [], [], []
    for k in v.plan.kernels:
        cuda = dataclasses.replace(generate(k, v.plan.tensors), block=block)
        res = compile_resources(cuda, ARCH)
        regs.append(res.regs)
        spill.append(res.spill_bytes)
        occ.append(occupancy(spec, res.regs, block, res.smem_bytes))
    return {
        "tag": v.tag,
        "k": v.k,
        "plan": v.plan.notation(),
        "kernels": len(v.plan.kernels),
        "regs_max": max(regs),
        "spill_bytes_max": max(spill),
        "blocks_per_sm_min": min(occ),
        "est_us": round(v.plan.est_us, 2),
        "bytes": v.plan.bytes,
    }


# ---------------------------------------------------------------- command


def run(args: argparse.Namespace) -> int:

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
    variants = [v for k in ks for v in chain_variants(k, args.n, spec, args.fat_temps, args.mode == "modes")]
    offline = [offline_row(v, spec, args.block) for v in variants]
    data = c05.c05_bundle([(v.tag, v.k, v.plan) for v in variants], args.mode, args.n, args.block, spec, offline)
    if args.export:
        c05.write_json(data, args.export)
        print(f"wrote C-05 {args.mode} bundle ({len(variants)} plans) to {args.export}; "
              f"on the GPU: python -m fusion_planner.backends.cupy c05 {args.export}")
        return 0
    result = c05.run_bundle(c05.bundle_variants(data), data, None if args.offline else c05.gpu_executor(),
                            args.warmup, args.repeats)
    if args.json:
        emit_json(result)
        return 0
    c05.print_result(result)
    return 0

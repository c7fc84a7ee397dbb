"""``fusion-planner bench c05``: seed 001 (C-05) with the planner's own generated kernels.

The chain of DIGEST.md (stage s: ``y = a_s*y + b_s``, ReLU on even s) is built
as a graph; its naive plan (one kernel per stage), fused plan (one kernel) and
fat plan (fused plus the 48-temporary register probe) come from the candidate
set.  Without a GPU only the offline part is printed: registers and spills
from ``nvcc -arch=sm_90 --resource-usage`` and occupancy from the device spec.
On a GPU the seed's two tables are measured (CUDA events, 2 warm-ups, median
of 7), with naive timed with and without the reference program's extra
device-to-device copies, and the fused kernel's bandwidth is compared with a
measured device-to-device copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from planner.cli import emit_json
from planner.cost import DeviceSpec, load_device
from planner.errors import UsageError
from planner.examples import ew_chain
from planner.plans import Plan

log = logging.getLogger(__name__)

#: seed 001's RTX 5090 figures (DIGEST.md): k -> (naive ms, fused ms)
SEED_SWEEP = {2: (0.318, 0.082), 3: (0.333, 0.084), 4: (0.490, 0.083), 6: (0.662, 0.083), 8: (0.832, 0.085)}
#: seed 001's modes at k = 4: tag -> (median ms, blocks/SM)
SEED_MODES = {"naive": (0.491, 6), "fused": (0.083, 6), "fat": (0.667, 1)}


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
    from planner.candidates import build_candidates

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
    from backends.cupy.codegen import generate
    from backends.cupy.facts import ARCH, compile_resources, occupancy

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


def print_offline(rows: list[dict[str, Any]], spec: DeviceSpec, n: int, block: int) -> None:
    from backends.cupy.facts import ARCH

    print(
        f"C-05 offline: n={n:,} fp32, block {block}, grid 8 x {spec.sm_count} SMs; registers and spills from "
        f"nvcc -arch={ARCH} --resource-usage, blocks/SM from the {spec.name} spec (no GPU timing)"
    )
    hdr = f"{'k':>2}  {'tag':<6} {'plan':<18} {'kernels':>7} {'regs':>5} {'spill B':>7} {'blocks/SM':>9} {'est us':>9}"
    print(hdr)
    for r in rows:
        print(
            f"{r['k']:>2}  {r['tag']:<6} {r['plan']:<18} {r['kernels']:>7} {r['regs_max']:>5} "
            f"{r['spill_bytes_max']:>7} {r['blocks_per_sm_min']:>9} {r['est_us']:>9.2f}"
        )


# ---------------------------------------------------------------- GPU part


def gpu_context() -> Any | None:
    try:
        from backends.cupy.gpu import CupyExecutor

        return CupyExecutor()
    except Exception as exc:  # no cupy, no driver or no device: the offline part still runs
        log.info("no GPU timing: %s", exc)
        print(f"no GPU timing on this machine ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        return None


def gpu_row(v: Variant, ex: Any, block: int, warmup: int, repeats: int) -> dict[str, Any]:
    import statistics

    import numpy as np

    from backends.cupy import gpu
    from backends.cupy.backend import plan_candidate
    from backends.cupy.verify import allclose_report
    from backends.reference import execute_plan

    cand = plan_candidate(v.plan)
    cand = dataclasses.replace(
        cand,
        kernels=tuple(
            dataclasses.replace(bk, cuda=dataclasses.replace(bk.cuda, block=block)) for bk in cand.kernels
        ),
    )
    x = np.random.default_rng(0).standard_normal(v.plan.tensors["x"].shape).astype(np.float32)
    prep = ex.prepare(cand, {"x": x})
    (got,) = prep.run()
    (want,) = execute_plan(v.plan, {"x": x}, mode="oracle")
    ok, max_abs, _ = allclose_report(got, want, "fp32")
    if not ok:
        raise UsageError(f"C-05 {v.tag} k={v.k}: GPU result differs from the reference (max_abs {max_abs:.3g})")
    med = statistics.median(prep.time(warmup, repeats))
    row = {"tag": v.tag, "k": v.k, "median_ms": med / 1e3, "kernel_facts": prep.kernel_facts}
    row["blocks_per_sm"] = min(f["occupancy"] for f in prep.kernel_facts)
    row["regs_max"] = max(f["regs"] for f in prep.kernel_facts)
    if v.tag == "naive":
        nbytes = x.nbytes
        rt = gpu.cp.cuda.runtime
        src = prep.bufs["x"]
        dst = gpu.cp.empty_like(src)

        def copy() -> None:
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, prep.stream.ptr)

        def with_copies() -> None:
            copy()
            prep.launch()
            if v.k % 2:
                copy()

        row["with_copy_ms"] = statistics.median(gpu.event_times(with_copies, prep.stream, warmup, repeats)) / 1e3
    return row


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
    variants = [v for k in ks for v in chain_variants(k, args.n, spec, args.fat_temps, args.mode == "modes")]
    offline = [offline_row(v, spec, args.block) for v in variants]
    result: dict[str, Any] = {"bench": "c05", "mode": args.mode, "n": args.n, "block": args.block,
                              "device_spec": spec.name, "offline": offline}
    ex = None if args.offline else gpu_context()
    if ex is not None:
        from backends.cupy import gpu

        result["machine"] = ex.machine()
        result["gpu"] = [gpu_row(v, ex, args.block, args.warmup, args.repeats) for v in variants]
        copy_us = gpu.d2d_copy_us(args.n * 4, args.warmup, args.repeats)
        result["d2d_copy_gbps"] = 2 * args.n * 4 / (copy_us * 1e-6) / 1e9
    if args.json:
        emit_json(result)
        return 0
    print_offline(offline, spec, args.n, args.block)
    if ex is not None:
        print_gpu(result, args.mode)
    return 0


def print_gpu(result: dict[str, Any], mode: str) -> None:
    rows = result["gpu"]
    m = result["machine"]
    print(f"\nmeasured on {m['device']} ({m['sm_count']} SMs), CUDA events, median of repeats")
    copy_gbps = result["d2d_copy_gbps"]
    n = result["n"]
    if mode == "sweep":
        print(f"{'k':>2} {'naive ms':>9} {'naive+copy ms':>13} {'fused ms':>9} {'fused/naive':>11} "
              f"{'fused/(naive+copy)':>18} {'bound k|k+1':>11} {'seed 5090':>9} {'fused BW/copy BW':>16}")
        by_k: dict[int, dict[str, Any]] = {}
        for r in rows:
            by_k.setdefault(r["k"], {})[r["tag"]] = r
        for k, d in sorted(by_k.items()):
            nv, fu = d["naive"], d["fused"]
            seed = SEED_SWEEP.get(k)
            seed_s = f"{seed[0] / seed[1]:.2f}x" if seed else "-"
            bw = 2 * n * 4 / (fu["median_ms"] * 1e-3) / 1e9
            print(f"{k:>2} {nv['median_ms']:>9.3f} {nv['with_copy_ms']:>13.3f} {fu['median_ms']:>9.3f} "
                  f"{nv['median_ms'] / fu['median_ms']:>10.2f}x {nv['with_copy_ms'] / fu['median_ms']:>17.2f}x "
                  f"{f'{k}|{k + 1}':>11} {seed_s:>9} {bw / copy_gbps:>15.0%}")
    else:
        d = {r["tag"]: r for r in rows}
        print(f"{'tag':<6} {'median ms':>9} {'blocks/SM':>9} {'regs':>5} {'relative':<28} seed 5090")
        rel = {
            "naive": f"with copies {d['naive']['with_copy_ms']:.3f} ms",
            "fused": f"fused/naive {d['naive']['median_ms'] / d['fused']['median_ms']:.2f}x",
            "fat": f"fat/fused {d['fat']['median_ms'] / d['fused']['median_ms']:.2f}x slower",
        }
        for tag in ("naive", "fused", "fat"):
            r = d[tag]
            s_ms, s_occ = SEED_MODES[tag]
            print(f"{tag:<6} {r['median_ms']:>9.3f} {r['blocks_per_sm']:>9} {r['regs_max']:>5} {rel[tag]:<28} "
                  f"{s_ms:.3f} ms, {s_occ} blocks/SM")
    print(f"device-to-device copy: {copy_gbps:,.0f} GB/s (read+write)")

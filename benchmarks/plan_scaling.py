"""Planning time vs graph size: e-nodes, build, saturate and extract times.

Usage: python benchmarks/plan_scaling.py [--out docs/results/plan_scaling.md]

Times are in-process (interpreter start excluded), best of --repeats runs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import time
from pathlib import Path

from planner.core.cost import load_device
from planner.core.examples import ew_chain, mlp_stack
from planner.core.machine import describe
from planner.core.report import Count, log10_count
from planner.egraph.candidates import build_candidates
from planner.egraph.program import Limits


def measure(graph, repeats: int) -> dict:
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = build_candidates(graph, load_device("h200"))
        total = time.perf_counter() - t0
        row = {
            "ops": len(graph.ops),
            "enodes": c.enodes,
            "space": c.space,
            "enumerated": c.complete,
            "build": c.times["build"],
            "saturate": c.times["saturate"],
            "extract": c.times["extract"],
            "total": total,
            "best": c.best.composition(),
        }
        if best is None or row["total"] < best["total"]:
            best = row
    return best


def fmt_space(n: Count) -> str:
    return f"{n:,}" if n < 10**7 else f"~1e{math.floor(log10_count(n))}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/results/plan_scaling.md")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    build_candidates(ew_chain(2, 64), load_device("h200"))  # warm imports
    rows = []
    for k in (2, 4, 8, 16, 32, 64):
        rows.append((f"ew-chain k={k}", measure(ew_chain(k, 2**24), args.repeats)))
    for layers in (1, 2, 4, 8, 16, 32, 64):
        rows.append((f"mlp-stack L={layers}", measure(mlp_stack(layers, 1024, 64, "fp16"), args.repeats)))
    lines = [
        "# Planning time vs graph size",
        "",
        f"Command: `python benchmarks/plan_scaling.py --repeats {args.repeats}`  ",
        f"Machine: {describe()}  ",
        f"Date: {datetime.date.today().isoformat()}  ",
        "Device spec: h200 (cost model only; nothing is executed). Best of "
        f"{args.repeats} in-process runs; interpreter start excluded.",
        "",
        "| graph | ops | e-nodes | plan space | enumerated | build ms | saturate ms | extract ms | total ms | best plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['ops']} | {r['enodes']} | {fmt_space(r['space'])} | {'yes' if r['enumerated'] else 'no'} | "
            f"{r['build'] * 1e3:.1f} | {r['saturate'] * 1e3:.1f} | {r['extract'] * 1e3:.1f} | {r['total'] * 1e3:.1f} | {r['best']} |"
        )
    lines += [
        "",
        "E-nodes grow linearly with the graph: each op contributes one stored class and one",
        "register form per fusable input, plus at most six cuBLASLt nodes per GEMM.",
        "Spaces up to the default cap (4096) are enumerated exactly; larger ones take the better of",
        "the tree DP and the stitched per-region exact plans, refined by exact local search, plus its",
        "neighbours and seeded samples (docs/cost-model.md). A fused kernel holds at most",
        f"{Limits().max_region_ops} ops (`--max-region-ops`): a longer chain needs two or more kernels.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Whole-model planning time and memory vs depth, with and without deduplication.

Usage: python benchmarks/scaling.py [--out docs/results/scaling.md]

Each configuration runs in a fresh subprocess so peak RSS is its own; times are
measured in-process there (interpreter start and imports excluded). Backend:
`model` (the cost-model choice), device spec h200, transformer stack with D=1024.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

from planner.core.machine import describe

CHILD = r"""
import json, resource, sys, time
from planner.core.examples import transformer
from planner.model.stack import plan_model
from planner.egraph.candidates import build_candidates
from planner.core.cost import load_device
layers, d, seq, dedup = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
spec = load_device("h200")
build_candidates(transformer(1, 64, 8), spec)  # warm imports and egglog
g = transformer(layers, d, seq)
t0 = time.perf_counter()
mp = plan_model(g, spec, dedup=dedup)
total = time.perf_counter() - t0
stats = [u.stats for u in mp.unique.values() if not u.cached]
print(json.dumps({
    "ops": len(g.ops), "regions": len(mp.regions), "unique": len(mp.unique),
    "enodes": sum(s["enodes"] for s in stats),
    "build": sum(s["build"] for s in stats),
    "saturate": sum(s["saturate"] for s in stats),
    "extract": sum(s["extract"] for s in stats),
    "total": total, "est_us": mp.plan.est_us, "kernels": len(mp.plan.kernels),
    "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def run(layers: int, d: int, seq: int, dedup: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(layers), str(d), str(seq), "1" if dedup else "0"],
        capture_output=True, text=True, check=True, timeout=1800,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/results/scaling.md")
    ap.add_argument("--layers", default="1,4,16,32,96")
    ap.add_argument("--no-dedup-layers", default="1,4,16,32", help="depths also planned without dedup")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    slow = {int(x) for x in args.no_dedup_layers.split(",") if x}
    rows = []
    for layers in depths:
        for dedup in (True, False):
            if not dedup and layers not in slow:
                continue
            r = run(layers, args.d_model, args.seq, dedup)
            rows.append((layers, dedup, r))
            print(layers, "dedup" if dedup else "whole", json.dumps(r), flush=True)
    t1 = next(r["total"] for layers, dd, r in rows if layers == depths[0] and dd)
    lines = [
        "# Whole-model planning: scaling with depth",
        "",
        f"Command: `python benchmarks/scaling.py --layers {args.layers} --no-dedup-layers {args.no_dedup_layers}`  ",
        f"Machine: {describe()}  ",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Graph: `--example transformer` (pre-LN decoder, GELU MLP), D={args.d_model}, S={args.seq}, fp16; "
        "device spec h200; backend `model` (cost-model choice). One fresh process per row; times exclude "
        "interpreter start and imports; RSS is the process peak (interpreter and egglog included).",
        "",
        "| layers | dedup | ops | regions | unique | e-nodes | build ms | saturate ms | extract ms | total ms | "
        "total / total(L=1) | est µs | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layers, dedup, r in rows:
        lines.append(
            f"| {layers} | {'on' if dedup else 'off'} | {r['ops']} | {r['regions']} | {r['unique']} | {r['enodes']} | "
            f"{r['build'] * 1e3:.1f} | {r['saturate'] * 1e3:.1f} | {r['extract'] * 1e3:.1f} | {r['total'] * 1e3:.1f} | "
            f"{r['total'] / t1:.2f} | {r['est_us']:.1f} | {r['rss_mb']:.0f} |"
        )
    lines += [
        "",
        "With dedup, the graph is cut where exactly one computed value is live and must be stored",
        "anyway (read by a GEMM, a standalone op such as attention's, or an Opaque op, or a graph output); each",
        "structurally unique region gets its own e-graph and extraction, and its plan is reused for every instance.",
        f"This stack has {max(r['unique'] for _, dd, r in rows if dd)} unique regions at its largest depth (layer 0 is cut "
        "differently: its input is a graph input). Without dedup the whole graph is one e-graph",
        "and the extractor runs over all of it (its search is seeded with the stitched per-region plans); it takes",
        "longer and needs more memory as depth grows, and " + _agreement(rows),
    ]
    # keep hand-added sections below the generated table (e.g. the CLI measurements)
    old = Path(args.out).read_text() if Path(args.out).exists() else ""
    tail = old[old.index("\n## ") :] if "\n## " in old else ""
    Path(args.out).write_text("\n".join(lines) + "\n" + tail)
    print("\n".join(lines))


def _agreement(rows: list[tuple[int, bool, dict[str, float]]]) -> str:
    """Whether the whole-graph plans reach the per-region estimates, depth by depth."""
    est = {(layers, dd): r["est_us"] for layers, dd, r in rows}
    worse = [f"{layers} layers ({est[(layers, False)]:.1f} vs {est[(layers, True)]:.1f} µs)" for layers, dd in est
             if not dd and (layers, True) in est and est[(layers, False)] > est[(layers, True)] * (1 + 1e-6)]
    if not worse:
        return "it reaches the same estimate."
    return ("it does not reach the per-region estimate at " + ", ".join(worse) + ": the stitched seed needs kernel "
            "bodies the extractor's per-value body cap (512) cut, so it settles for its own best.")


if __name__ == "__main__":
    main()

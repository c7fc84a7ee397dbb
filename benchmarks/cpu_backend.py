"""Fused vs unfused on the CPU backend: ew-chain k = 2..8, measured side by side.

Usage: python benchmarks/cpu_backend.py [--n 4000000] [--kmin 2] [--kmax 8] [--rounds 5] [--out FILE.md]

For each k the fully fused plan (one generated C loop) and the unfused plan
(one generated C kernel per op, every intermediate stored and re-read) are
compiled first, then timed in alternating rounds (so both see the same machine
load); each figure is the median over all rounds' samples.  Both plans'
outputs are checked against the reference executor before timing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from backends.cpu.backend import CpuBackend
from planner.core.cost import load_device
from planner.core.examples import ew_chain
from planner.core.machine import cpu_model
from planner.core.reference import execute_plan, random_inputs
from planner.egraph.candidates import build_candidates


def _timed(fn, repeats: int) -> list[float]:  # noqa: ANN001
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def measure(k: int, n: int, rounds: int, backend: CpuBackend) -> dict:
    graph = ew_chain(k, n)
    cands = build_candidates(graph, backend.spec)
    fused = min(cands.plans, key=lambda p: len(p.kernels))
    unfused = cands.unfused
    assert len(fused.kernels) == 1 and len(unfused.kernels) == len(graph.ops)
    inputs = random_inputs(graph, seed=0)
    compiled = {"fused": backend.compile(fused), "unfused": backend.compile(unfused)}
    want = execute_plan(fused, inputs)[0]
    for name, c in compiled.items():
        got = c.run(inputs)[0]
        if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"k={k}: the {name} plan disagrees with the reference")
    samples: dict[str, list[float]] = {"fused": [], "unfused": [], "memcpy": [], "triad": []}
    copy_src = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    copy_dst, triad_b = np.empty_like(copy_src), copy_src[::-1].copy()
    for _ in range(rounds):  # the contenders and the bandwidth references alternate, round by round
        for name, c in compiled.items():
            samples[name] += c.time(inputs, warmup=1, repeats=3).samples_us
        samples["memcpy"] += _timed(lambda: np.copyto(copy_dst, copy_src), 3)
        samples["triad"] += _timed(lambda: np.add(copy_src, triad_b, out=copy_dst), 3)
    f, u = statistics.median(samples["fused"]), statistics.median(samples["unfused"])
    fused_bytes = sum(x["bytes_moved"] for x in compiled["fused"].kernel_facts)
    memcpy_gbps = 2 * copy_src.nbytes / (statistics.median(samples["memcpy"]) * 1e3)
    triad_gbps = 3 * copy_src.nbytes / (statistics.median(samples["triad"]) * 1e3)
    return {
        "memcpy_gbps": memcpy_gbps,
        "triad_gbps": triad_gbps,
        "fused_gbps": fused_bytes / (f * 1e3),
        "k": k,
        "ops": len(graph.ops),
        "fused_us": f,
        "unfused_us": u,
        "ratio": u / f,
        "fused_mb": sum(x["bytes_moved"] for x in compiled["fused"].kernel_facts) / 1e6,
        "unfused_mb": sum(x["bytes_moved"] for x in compiled["unfused"].kernel_facts) / 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4_000_000)
    ap.add_argument("--kmin", type=int, default=2)
    ap.add_argument("--kmax", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="also write the table as markdown here")
    args = ap.parse_args()
    # one thread on one core, as memcpy and triad (numpy's) run: the script pins itself
    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    backend = CpuBackend(load_device("seed-k4"), threads=1)
    load_before = os.getloadavg()[0]
    head = ("| k | ops | fused µs | unfused µs | unfused/fused | fused MB moved | unfused MB moved "
            "| fused GB/s | memcpy GB/s | triad GB/s | fused / memcpy |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    print(head)
    for k in range(args.kmin, args.kmax + 1):
        r = measure(k, args.n, args.rounds, backend)
        line = (
            f"| {r['k']} | {r['ops']} | {r['fused_us']:.0f} | {r['unfused_us']:.0f} | {r['ratio']:.2f}x "
            f"| {r['fused_mb']:.0f} | {r['unfused_mb']:.0f} | {r['fused_gbps']:.1f} | {r['memcpy_gbps']:.1f} "
            f"| {r['triad_gbps']:.1f} | {r['fused_gbps'] / r['memcpy_gbps']:.0%} |"
        )
        lines.append(line)
        print(line, flush=True)
    if args.out:
        cmd = "python benchmarks/cpu_backend.py " + " ".join(sys.argv[1:])
        meta = (
            f"Command: `{cmd}`  \nMachine: {platform.machine()}, {os.cpu_count()} CPUs, {cpu_model()}; "
            f"the plans on {backend.threads} thread(s)  \n"
            f"Date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}, n = {args.n:,} fp32, "
            f"load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after (other jobs share the machine)\n\n"
        )
        note = (
            f"\n\nOne thread, pinned by the script to core {core}. The fused plan is one generated C loop; "
            "the unfused plan one generated kernel per op. memcpy is numpy's `copyto` and triad `add(a, b, out=c)` on "
            f"{args.n:,}-element fp32 arrays, timed in the same rounds; GB/s counts bytes read plus written "
            "(the byte ledger's bytes for the fused kernel). A kernel writes its output with streaming stores "
            "where a measurement on this machine says they pay, as glibc's memcpy writes large copies "
            "(docs/backends.md, \"Streaming stores\").\n"
        )
        Path(args.out).write_text("# CPU backend: fused vs unfused ew-chain\n\n" + meta + "\n".join(lines) + note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

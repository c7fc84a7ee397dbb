"""The generated CPU kernels as AVX-512 code and as AVX2 code, on this machine.

Usage: python benchmarks/isa_kernels.py [--rounds 15] [--out FILE.md]

Machines of this kind come with AVX-512 (Intel Sapphire Rapids) or with AVX2 only (AMD EPYC). Where AVX-512 is
present, the CPU backend's compiler can be told to target the machine without it (``Compiler(target=
("-mno-avx512f",))``: gcc then compiles the prelude's 8-lane branch, as on an AVX2 machine), so both forms of
each fused kernel run here on the same core: the row kernels (softmax over attention scores, a residual
LayerNorm, RMSNorm) and the fused attention (24 groups of 64-wide heads, plain and causal). Each plan is the
fused one (the fewest kernels), checked against the unfused graph's numpy semantics for both targets, then
both are timed in alternating rounds on one pinned thread (``compiled.execute()``: the bare kernels); each
figure is the median over all rounds. This measures the generated code, not the machine: an AVX2 machine's
cores, caches and memory differ.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from backends.cpu.backend import CpuBackend
from backends.cpu.compiler import Compiler
from planner.core import examples
from planner.core.cost import load_device
from planner.core.graph import Graph
from planner.core.machine import cpu_model
from planner.core.reference import execute_graph, random_inputs
from planner.egraph.candidates import build_candidates

SPEC = load_device("h200")
TARGETS = {"AVX-512": (), "AVX2": ("-mno-avx512f",)}


def workloads() -> dict[str, Graph]:
    return {
        "softmax 24576x128": examples.softmax(24576, 128),
        "layernorm 2048x1024 (+residual)": examples.layer_norm(2048, 1024),
        "rmsnorm 2048x2048": examples.rms_norm(2048, 2048, "fp32", residual=False),
        "attention 2x128 tokens, 12 heads of 64": examples.attention(2, 128, 768, 12, "fp32", causal=False),
        "attention 1x512 tokens, 12 heads of 64, causal": examples.attention(1, 512, 768, 12, "fp32", causal=True),
    }


def measure(name: str, graph: Graph, rounds: int) -> dict[str, float]:
    plan = min(build_candidates(graph, SPEC).plans, key=lambda p: (len(p.kernels), p.sort_key()))
    inputs = random_inputs(graph, seed=1)
    want = execute_graph(graph, inputs)
    runs = {}
    for target, flags in TARGETS.items():
        compiled = CpuBackend(SPEC, threads=1, compiler=Compiler(target=flags)).compile(plan)
        for got, w in zip(compiled.run(inputs), want, strict=True):
            np.testing.assert_allclose(got, w, rtol=2e-4, atol=2e-5, err_msg=f"{name}, {target} code")
        compiled.time(inputs, warmup=2, repeats=1)  # binds the inputs
        runs[target] = compiled.execute
    samples: dict[str, list[float]] = {t: [] for t in runs}
    for r in range(rounds):
        for target in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            for _ in range(3):
                t0 = time.perf_counter_ns()
                runs[target]()
                samples[target].append((time.perf_counter_ns() - t0) / 1e3)
    return {t: statistics.median(v) for t, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit("this benchmark compiles x86 targets")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rows = []
    for name, graph in workloads().items():
        m = measure(name, graph, args.rounds)
        rows.append(f"| {name} | {m['AVX-512']:,.0f} | {m['AVX2']:,.0f} | {m['AVX2'] / m['AVX-512']:.2f} |")
        print(rows[-1], flush=True)
    cc = subprocess.run([os.environ.get("CC", "cc"), "--version"], capture_output=True, text=True).stdout.splitlines()
    text = "\n".join([
        "# The generated CPU kernels as AVX-512 code and as AVX2 code, on one machine",
        "",
        f"Command: `python benchmarks/isa_kernels.py{f' --out {args.out}' if args.out else ''}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}, {os.cpu_count()} CPUs), Python {platform.python_version()}, "
        f"{cc[0] if cc else 'cc'}  ",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "Method: the module docstring. Medians in µs of the bare kernels of each fused plan, one pinned thread; "
        "*AVX2*: the same kernels compiled with `-mno-avx512f` after `-march=native`.",
        "",
        "| kernel | AVX-512 code | AVX2 code | AVX2 / AVX-512 |",
        "|---|---|---|---|",
        *rows,
        "",
    ])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    sys.exit(main())

"""How a weight's layout changes a GEMM library's fp32 product: nn.Linear's (N, K), a (K, N) copy, padded rows,
and oneDNN's product from a weight packed once.

Usage: python benchmarks/gemm_layouts.py [--rounds 15] [--out docs/results/gemm_layouts.md]

On one pinned thread (BLAS and torch at one thread), for each shape M×K×N, ``torch.mm`` (MKL in torch's x86
wheels) and ``np.matmul`` (OpenBLAS in numpy's) multiply a C-ordered (M, K) activation by a weight held three
ways: nn.Linear's (N, K) array read as its transpose (what eager ``F.linear`` multiplies), a C-ordered (K, N)
copy, and the CPU backend's padded (K, N) layout (``backends/cpu/buffers.padded_matrix``: rows an odd number
of cache lines apart); and oneDNN (through torch) multiplies the activation by the weight reordered once into
its blocked form (``gemm.pack_weight``/``gemm.packed_linear``: the backend's ``packed`` layout), returning a fresh
tensor.  Every contender runs once per round, the order rotating, all in one process; a figure is the median
over the rounds, in µs.  The backend's own choice for each shape (``gemm.shape_layout``, packed included) is printed too.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from backends.cpu import gemm
from backends.cpu.buffers import aligned_empty, padded_matrix
from planner.core.machine import cpu_model

SHAPES = ((128, 768, 2304), (128, 768, 3072), (128, 3072, 768), (128, 768, 768), (64, 2048, 2048),
          (128, 1000, 1000), (1024, 1024, 1024))
LAYOUTS = ("nn.Linear (N, K)", "(K, N) copy", "padded (K, N)")
LIBRARIES = {"torch.mm (MKL)": gemm.matmul("torch"), "np.matmul (OpenBLAS)": gemm.numpy_mm}
PACKED = ("oneDNN", "packed")


def weights(k: int, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    linear = aligned_empty((n, k), np.float32)
    linear[...] = rng.standard_normal((n, k), dtype=np.float32)
    copy = aligned_empty((k, n), np.float32)
    copy[...] = linear.T
    padded = padded_matrix(k, n, np.float32)
    padded[...] = linear.T
    return dict(zip(LAYOUTS, (linear.T, copy, padded), strict=True))


def measure(rounds: int) -> dict[tuple[int, int, int], dict[tuple[str, str], float]]:
    rng = np.random.default_rng(0)
    out = {}
    for m, k, n in SHAPES:
        a = aligned_empty((m, k), np.float32)
        a[...] = rng.standard_normal((m, k), dtype=np.float32)
        result = aligned_empty((m, n), np.float32)
        held = weights(k, n, rng)
        calls: dict[tuple[str, str], Callable[[], object]] = {
            (lib, layout): (lambda mm=mm, w=w, a=a, result=result: mm(a, w, result))
            for lib, mm in LIBRARIES.items() for layout, w in held.items()}
        calls[PACKED] = functools.partial(gemm.packed_linear("fp32"), a, gemm.pack_weight(held[LAYOUTS[0]], "fp32"))
        samples: dict[tuple[str, str], list[float]] = {c: [] for c in calls}
        order = list(calls)
        for fn in calls.values():
            fn()
        for r in range(rounds):
            for c in order[r % len(order):] + order[: r % len(order)]:
                t0 = time.perf_counter_ns()
                calls[c]()
                samples[c].append((time.perf_counter_ns() - t0) / 1e3)
        out[(m, k, n)] = {c: statistics.median(v) for c, v in samples.items()}
    return out


def report(figures: dict[tuple[int, int, int], dict[tuple[str, str], float]], command: str) -> str:
    head = [f"{lib}: {layout}" for lib in LIBRARIES for layout in LAYOUTS] + ["oneDNN: packed once"]
    lines = ["# A weight's layout and the GEMM libraries' fp32 product", "",
             f"Command: `{command}`  ",
             f"Machine: {cpu_model()} ({platform.machine()}), one pinned thread, Python {platform.python_version()}  ",
             f"Date: {datetime.date.today().isoformat()}  ",
             f"Versions: numpy {np.__version__}, torch {torch.__version__}  ",
             "The CPU backend's choice here (`gemm.shape_layout`: per shape, torch loaded): " + "; ".join(
                 f"{'×'.join(map(str, shape))} torch {gemm.shape_layout('torch', gemm.fp32_packs(), shape)}, numpy "
                 f"{gemm.shape_layout('numpy', gemm.fp32_packs(), shape)}" for shape in figures), "",
             "Method: benchmarks/gemm_layouts.py's docstring. Medians in µs.", "",
             "| M×K×N | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for shape, per in figures.items():
        cells = [f"{per[(lib, layout)]:,.0f}" for lib in LIBRARIES for layout in LAYOUTS] + [f"{per[PACKED]:,.0f}"]
        lines.append(f"| {'×'.join(map(str, shape))} | " + " | ".join(cells) + " |")
    lines += ["", "Padded over nn.Linear's layout (> 1: padded is faster): " + "; ".join(
        f"{'×'.join(map(str, shape))}: " + ", ".join(
            f"{lib.split()[0]} {per[(lib, LAYOUTS[0])] / per[(lib, LAYOUTS[2])]:.2f}" for lib in LIBRARIES)
        for shape, per in figures.items())]
    lines += ["", "Packed once (oneDNN) over the best of the other six (> 1: packed is faster): " + "; ".join(
        f"{'×'.join(map(str, shape))}: {min(v for c, v in per.items() if c != PACKED) / per[PACKED]:.2f}"
        for shape, per in figures.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", help="write the markdown report here")
    args = p.parse_args()
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    with threadpool_limits(limits=1, user_api="blas"):
        text = report(measure(args.rounds), " ".join(["python benchmarks/gemm_layouts.py", *sys.argv[1:]]))
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

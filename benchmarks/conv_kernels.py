"""3x3 convolutions on the CPU backend: oneDNN's (through torch) against Winograd's F(4x4, 3x3), on this machine.

Usage: python benchmarks/conv_kernels.py [--rounds 15] [--out FILE.md]

The convolutions of the CNN benchmark (ResNet-18's stages, a small CNN's blocks) as the CPU backend runs a
convolution GEMM's product over channels-last rows: ``gemm.torch_conv`` (oneDNN's convolution, its weight
reordered once) and ``winograd.winograd_conv`` in one block of every tile and in blocks sized to the L2
(``winograd.block_tiles``), fp32 and bf16 (bf16: oneDNN's native bf16 product where the CPU has the units;
Winograd's in fp32 from the stored values).  Each is checked against the convolution in fp64 (the largest error
as a share of the dtype's tolerance), then all are timed in interleaved rounds: *warm*, a call right after a
call of itself; *evicted*, a call after 64 MB were written (its weight, its work memory and its input out of the
caches, as when other layers ran between).  Figures are medians in µs; one pinned core (``1``), then every core
(``all``: the transforms split across the backend's pool, the products on torch's threads).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.cpu import gemm, native_pool, parallel, winograd
from backends.cpu.compiler import Compiler
from backends.cpu.memory import from_storage, storage_dtype, to_storage
from planner.core.machine import cpu_model
from planner.core.tolerance import TOLERANCES

#: (label, images, channels in, channels out, height = width)
SHAPES = (("ResNet-18 stage 1", 1, 64, 64, 56), ("ResNet-18 stage 2", 1, 128, 128, 28),
          ("ResNet-18 stage 3", 1, 256, 256, 14), ("ResNet-18 stage 4", 1, 512, 512, 7),
          ("small CNN block", 8, 32, 32, 16))
EVICT_BYTES = 64 << 20


def _window(size: int) -> dict[str, int]:
    return {"height": size, "width": size, "kh": 3, "kw": 3, "sh": 1, "sw": 1, "ph": 1, "pw": 1, "dh": 1, "dw": 1}


def _direct(x: np.ndarray, w: np.ndarray, images: int, size: int) -> np.ndarray:
    c, o = x.shape[1], w.shape[1]
    xs = torch.tensor(x, dtype=torch.float64).view(images, size, size, c).permute(0, 3, 1, 2)
    ws = torch.tensor(w, dtype=torch.float64).view(3, 3, c, o).permute(3, 2, 0, 1)
    return torch.nn.functional.conv2d(xs, ws, None, 1, 1).permute(0, 2, 3, 1).reshape(-1, o).numpy()


def contenders(images: int, channels: int, outputs: int, size: int, dtype: str, threads: int,
               pool: parallel.WorkerPool, compiler: Compiler) -> dict[str, Callable[[np.ndarray, np.ndarray], Any]]:
    window = _window(size)
    tiles = math.ceil(size / winograd.TILE) ** 2 * images
    block = winograd.block_for(window, images, channels, outputs, threads)
    out: dict[str, Callable[[np.ndarray, np.ndarray], Any]] = {"oneDNN": gemm.torch_conv(dtype, window)}
    for blocks in dict.fromkeys((tiles, block)):
        out[f"Winograd, blocks of {blocks}"] = winograd.winograd_conv(window, images, channels, outputs,
                                                                      compiler.function, pool, threads, dtype, blocks)
    return out


def measure(images: int, channels: int, outputs: int, size: int, dtype: str, threads: int, rounds: int,
            pool: parallel.WorkerPool, compiler: Compiler) -> dict[str, tuple[float, float, float]]:
    """Per contender: (warm µs, evicted µs, error as a share of the tolerance)."""
    rng = np.random.default_rng(0)
    stored = storage_dtype(dtype)
    x = np.empty((images * size * size, channels), stored)
    w = np.empty((9 * channels, outputs), stored)
    to_storage(np.asarray(rng.standard_normal(x.shape, dtype=np.float32)), dtype, x)
    to_storage(np.asarray(rng.standard_normal(w.shape, dtype=np.float32) / np.sqrt(9 * channels)), dtype, w)
    w.flags.writeable = False
    want = _direct(from_storage(x, dtype), from_storage(w, dtype), images, size)
    rtol, atol = TOLERANCES[dtype]
    junk = np.ones(EVICT_BYTES, np.uint8)
    calls = contenders(images, channels, outputs, size, dtype, threads, pool, compiler)
    errors: dict[str, float] = {}
    warm: dict[str, list[float]] = {n: [] for n in calls}
    evicted: dict[str, list[float]] = {n: [] for n in calls}
    with parallel.torch_threads(threads):
        for name, conv in calls.items():
            got = conv(x, w)
            got = got.float().numpy() if hasattr(got, "numpy") else np.asarray(got)
            if got.dtype == np.uint16:
                got = from_storage(got, dtype)
            errors[name] = float((np.abs(got - want) / (atol * np.abs(want).max() + rtol * np.abs(want))).max())
            if errors[name] > 1:
                raise SystemExit(f"{name} differs from the convolution beyond {dtype}'s tolerance")
        for r in range(rounds):
            for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                junk[::64] += 1
                t0 = time.perf_counter_ns()
                calls[name](x, w)
                evicted[name].append((time.perf_counter_ns() - t0) / 1e3)
                t0 = time.perf_counter_ns()
                calls[name](x, w)
                warm[name].append((time.perf_counter_ns() - t0) / 1e3)
    return {n: (statistics.median(warm[n]), statistics.median(evicted[n]), errors[n]) for n in calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--modes", default="1,all")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cores = os.sched_getaffinity(0)
    compiler = Compiler()
    lines = []
    for mode in args.modes.split(","):
        threads = 1 if mode == "1" else len(cores)
        os.sched_setaffinity(0, {max(cores)} if mode == "1" else cores)
        torch.set_num_threads(threads)
        pool = parallel.WorkerPool(threads)
        if threads > 1:
            pool.attach(native_pool.start_shared_pool(compiler, threads))
        lines += [f"## {'one thread, pinned' if mode == '1' else f'all cores ({threads} threads)'}", "",
                  "| convolution | dtype | product | warm | evicted | error / tolerance |", "|---|---|---|---|---|---|"]
        for label, images, channels, outputs, size in SHAPES:
            for dtype in ("fp32", "bf16"):
                if dtype == "bf16" and not gemm.native_16bit("bf16"):
                    continue
                m = measure(images, channels, outputs, size, dtype, threads, args.rounds, pool, compiler)
                for name, (warm, cold, err) in m.items():
                    lines.append(f"| {label}: {images}x{channels}x{size}x{size} -> {outputs} | {dtype} | {name} | "
                                 f"{warm:,.0f} | {cold:,.0f} | {err:.2f} |")
                    print(lines[-1], flush=True)
        lines.append("")
    text = "\n".join([
        "# 3x3 convolutions: oneDNN's against Winograd's F(4x4, 3x3)",
        "",
        f"Command: `python benchmarks/conv_kernels.py{f' --out {args.out}' if args.out else ''}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}, {len(cores)} CPUs), Python {platform.python_version()}, "
        f"torch {torch.__version__}  ",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        "Method: the module docstring. Medians in µs of the convolution's product (no epilogue); *error / "
        "tolerance*: the largest error against the convolution in fp64 as a share of what the dtype's tolerance "
        "allows that element.",
        "",
        *lines,
    ])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    sys.exit(main())

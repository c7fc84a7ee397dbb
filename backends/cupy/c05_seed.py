"""Seed 001's own C-05 program, reproduced: its three kernels and the order of its device operations.

The seed (``../shared/seeds/DIGEST.md``, "Seed 001") timed a chain of k elementwise stages on an RTX 5090:
stage ``s`` computes ``y = a_s*y + b_s`` with ``a_s = 1 + 0.01(s+1)``, ``b_s = 0.001(s+1)``, then ReLU on even
``s``; n = 2^24 floats, block 256, grid 8 x SMs with a grid-stride loop, scalar loads; CUDA events around a
whole run, 2 warm-ups, 7 runs, median. Its modes:

* **naive**: one ``c05_stage`` launch per stage, ping-ponging between the output and a scratch buffer. Each
  run first copies the input into the scratch buffer (device to device); the stages alternate scratch -> out,
  out -> scratch, ...; after an even number of stages the result sits in the scratch buffer and a last copy
  moves it to the output (:func:`naive_schedule`).
* **fused**: one ``c05_fused`` launch, the stages in registers.
* **fat**: ``c05_fat``: fused, plus 48 live temporaries ``stage_op(v*(1+1e-4(t+1)) + ((i+t)&1023)*1e-3, t mod
  k)`` summed per thread, reduced across the warp with ``__shfl_down_sync``, lane 0 adding its warp's sum into a
  sink with ``atomicAdd``; each run starts with a ``cudaMemset`` of the sink. A register-pressure probe.

The planner's own kernels for the same chains (vectorised loads) are timed beside these as separate rows
(``backends.cupy.c05``); this module is the reproduction. It needs cupy only in :func:`run_seed` (on a GPU).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.cupy.kernel import CudaKernel

#: the seed's launch shape and problem size
SEED_N = 1 << 24
SEED_BLOCK = 256
SEED_GRID_PER_SM = 8
FAT_TEMPS = 48
#: the seed's verification: |got - expected| <= 1e-4 * (|expected| + 1)
SEED_TOLERANCE = 1e-4

SEED_COMMON = r"""
__device__ __forceinline__ float c05_stage_op(float v, int s) {
    const float a = 1.0f + 0.01f * (float)(s + 1);
    const float b = 0.001f * (float)(s + 1);
    v = a * v + b;
    return (s % 2 == 0) ? fmaxf(v, 0.0f) : v;
}
"""

#: each kernel's own source (the shared stage after it), so each compiles, and is reported, on its own
SEED_BODIES = {
    "c05_stage": r"""
extern "C" __global__ void c05_stage(const float* __restrict__ in, float* __restrict__ out, long long n, int s) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = c05_stage_op(in[i], s);
}
""",
    "c05_fused": r"""
extern "C" __global__ void c05_fused(const float* __restrict__ in, float* __restrict__ out, long long n, int k) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = in[i];
        for (int s = 0; s < k; ++s) v = c05_stage_op(v, s);
        out[i] = v;
    }
}
""",
    "c05_fat": r"""
extern "C" __global__ void c05_fat(const float* __restrict__ in, float* __restrict__ out, float* __restrict__ sink,
                                   long long n, int k) {
    float acc = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = in[i];
        for (int s = 0; s < k; ++s) v = c05_stage_op(v, s);
        out[i] = v;
        float tmp[FAT_TEMPS];
#pragma unroll
        for (int t = 0; t < FAT_TEMPS; ++t)
            tmp[t] = c05_stage_op(v * (1.0f + 1e-4f * (float)(t + 1)) + (float)((i + t) & 1023) * 1e-3f, t % k);
#pragma unroll
        for (int t = 0; t < FAT_TEMPS; ++t) acc += tmp[t];
    }
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if ((threadIdx.x & 31) == 0) atomicAdd(sink, acc);
}
""".replace("FAT_TEMPS", str(FAT_TEMPS)),
}

#: kernel name -> parameter names, in order (``n``, ``s`` and ``k`` are scalars)
SEED_KERNELS = {"c05_stage": ("in", "out", "n", "s"), "c05_fused": ("in", "out", "n", "k"),
                "c05_fat": ("in", "out", "sink", "n", "k")}


def seed_kernels() -> list[CudaKernel]:
    """The seed's kernels, one program each, for NVRTC (``backends.cupy.nvrtc.compile_each``) and the device."""
    return [CudaKernel(name=name, kind="elementwise", source=SEED_COMMON + SEED_BODIES[name], params=params,
                       block=SEED_BLOCK, grid=(1, 1), grid_per_sm=SEED_GRID_PER_SM)
            for name, params in SEED_KERNELS.items()]


@dataclass(frozen=True)
class Op:
    """One device operation of a seed run: ``copy`` (src -> dst), ``stage`` s (src -> dst), ``fused``, ``fat``
    or ``memset`` (of ``dst``)."""

    kind: str
    src: str = ""
    dst: str = ""
    stage: int = -1


def naive_schedule(k: int) -> list[Op]:
    """The seed's naive run: copy the input into the scratch buffer, then stage s reads the scratch buffer
    when s is even and the output when s is odd, writing the other; after an even k the result is in the
    scratch buffer, and one more copy moves it to the output."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    ops = [Op("copy", "x", "scratch")]
    for s in range(k):
        src, dst = ("scratch", "out") if s % 2 == 0 else ("out", "scratch")
        ops.append(Op("stage", src, dst, s))
    if k % 2 == 0:
        ops.append(Op("copy", "scratch", "out"))
    return ops


def schedule(mode: str, k: int) -> list[Op]:
    """The device operations of one timed run of ``mode``."""
    if mode == "naive":
        return naive_schedule(k)
    if mode == "fused":
        return [Op("fused", "x", "out")]
    if mode == "fat":
        return [Op("memset", dst="sink"), Op("fat", "x", "out")]
    raise ValueError(f"unknown C-05 mode {mode!r} (naive, fused, fat)")


def copies(mode: str, k: int) -> int:
    """Device-to-device copies in one run (the seed's naive: 1, plus 1 when k is even)."""
    return sum(op.kind == "copy" for op in schedule(mode, k))


def stage_op(v: np.ndarray, s: int) -> np.ndarray:
    """The seed's stage in fp32 (the kernels' arithmetic: multiply, add, then ReLU on even stages)."""
    a = np.float32(1.0) + np.float32(0.01) * np.float32(s + 1)
    b = np.float32(0.001) * np.float32(s + 1)
    y = (a * v.astype(np.float32) + b).astype(np.float32)
    return np.maximum(y, np.float32(0.0)) if s % 2 == 0 else y


def expected(x: np.ndarray, k: int) -> np.ndarray:
    """The host loop the seed verifies against (fp64 through the chain, as a host loop in double would)."""
    y = x.astype(np.float64)
    for s in range(k):
        y = (1.0 + 0.01 * (s + 1)) * y + 0.001 * (s + 1)
        if s % 2 == 0:
            y = np.maximum(y, 0.0)
    return y


def verify(got: np.ndarray, x: np.ndarray, k: int) -> float:
    """The largest error in units of the seed's tolerance; raises past it."""
    want = expected(x, k)
    ratio = float(np.max(np.abs(got.astype(np.float64) - want) / (SEED_TOLERANCE * (np.abs(want) + 1.0))))
    if not ratio <= 1.0:
        raise RuntimeError(f"C-05 seed program, k={k}: result off by {ratio:.3g}x the seed's tolerance")
    return ratio


def emulate(mode: str, k: int, x: np.ndarray, ops: list[Op] | None = None) -> dict[str, np.ndarray]:
    """Run a mode's schedule (or ``ops``) on host arrays, doing what each device operation does to the
    buffers: the tests check the copy rule and where the result ends up with it."""
    bufs = {"x": x.astype(np.float32), "out": np.full_like(x, np.nan, np.float32),
            "scratch": np.full_like(x, np.nan, np.float32), "sink": np.zeros(1, np.float32)}
    for op in schedule(mode, k) if ops is None else ops:
        if op.kind == "copy":
            bufs[op.dst] = bufs[op.src].copy()
        elif op.kind == "stage":
            bufs[op.dst] = stage_op(bufs[op.src], op.stage)
        elif op.kind in ("fused", "fat"):
            y = bufs[op.src]
            for s in range(k):
                y = stage_op(y, s)
            bufs[op.dst] = y
        elif op.kind == "memset":
            bufs[op.dst] = np.zeros_like(bufs[op.dst])
    return bufs


# ---------------------------------------------------------------- on the GPU


def run_seed(mode: str, k: int, *, n: int = SEED_N, warmup: int = 2, repeats: int = 7, seed: int = 0) -> dict[str, Any]:
    """One mode of the seed's program on this GPU: verified against the host loop, then ``warmup`` and
    ``repeats`` timed runs (CUDA events around a whole run); median ms, occupancy from the driver's API,
    registers and local memory of each kernel it launches."""
    import cupy as cp

    from backends.cupy.gpu import compiled_facts, event_times, raw_kernel, sm_count

    sms = sm_count()
    grid = (SEED_GRID_PER_SM * sms,)
    kernels = {k_.name: raw_kernel(k_) for k_ in seed_kernels()}
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    # the input's copy and the sink's zeros on the program's own stream: a non-blocking stream is not ordered
    # after the legacy default stream, so the first run could read x before its copy landed (seen on the H200)
    with stream:
        bufs = {"x": cp.asarray(x), "out": cp.empty(n, cp.float32), "scratch": cp.empty(n, cp.float32),
                "sink": cp.zeros(1, cp.float32)}
    stream.synchronize()
    rt = cp.cuda.runtime
    nbytes = n * 4

    def launch(op: Op) -> Callable[[], None]:
        if op.kind == "copy":
            src, dst = bufs[op.src], bufs[op.dst]
            return lambda: rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, stream.ptr)
        if op.kind == "memset":
            dst = bufs[op.dst]
            return lambda: rt.memsetAsync(dst.data.ptr, 0, dst.nbytes, stream.ptr)
        name = {"stage": "c05_stage", "fused": "c05_fused", "fat": "c05_fat"}[op.kind]
        args: tuple[Any, ...] = (bufs[op.src], bufs[op.dst])
        if op.kind == "fat":
            args += (bufs["sink"],)
        args += (np.int64(n), np.int32(op.stage if op.kind == "stage" else k))
        kern = kernels[name]
        return lambda: kern(grid, (SEED_BLOCK,), args, stream=stream)

    steps = [launch(op) for op in schedule(mode, k)]

    def run() -> None:
        for step in steps:
            step()

    with stream:
        run()
    stream.synchronize()
    error = verify(cp.asnumpy(bufs["out"]), x, k)
    samples = event_times(run, stream, warmup, repeats)
    used = sorted({"c05_stage" if op.kind == "stage" else f"c05_{op.kind}" for op in schedule(mode, k)
                   if op.kind in ("stage", "fused", "fat")})
    facts = {name: compiled_facts(kernels[name], SEED_BLOCK) for name in used}
    return {"source": "seed", "tag": mode, "k": k, "median_ms": statistics.median(samples) / 1e3,
            "copies": copies(mode, k), "error_of_tolerance": error,
            "blocks_per_sm": min(f["occupancy"] for f in facts.values()),
            "regs_max": max(f["regs"] for f in facts.values()), "kernel_facts": facts}


__all__ = ["SEED_BODIES", "SEED_COMMON", "Op", "copies", "emulate", "expected", "naive_schedule", "run_seed", "schedule",
           "seed_kernels", "stage_op", "verify"]

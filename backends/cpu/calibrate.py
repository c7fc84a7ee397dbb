"""Measure this machine for the cost model: a DeviceSpec the CPU backend's plans can be costed with.

Four microbenchmarks, each run the way the CPU backend runs kernels:

* triad bandwidth: the generated C kernel of ``a = b + 3*c`` (fp32, arrays far
  larger than the caches), bytes counted as the byte ledger counts them
  (two reads and one write per element);
* empty-kernel overhead: a generated no-op kernel called through ctypes with
  the generated kernels' calling convention, as a plan step calls it;
* GEMM FLOP/s through numpy/BLAS (fp32) at three square sizes; the peak is the
  best of the three, and ``gemm_efficiency`` is the fraction of the untiled rate
  that the backend's row-tiled GEMM reaches at the largest size;
* vector FLOP/s: a generated chain of 16 Affine stages on a cache-resident array.

The CPU backend computes fp16/bf16 GEMMs in fp32, so every dtype gets the fp32 peak.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.cpu import stream_probe
from backends.cpu.codegen import CKernel, generate, noop_source
from backends.cpu.compiler import Compiler, cache_dir, keep_record, read_record
from backends.cpu.memory import blas_threads_from_env, cache_bytes, gemm_tile_rows, limit_blas_threads
from planner.core.cost import DeviceSpec, DeviceSpecError, device_from_json
from planner.core.graph import TensorType
from planner.core.machine import cpu_model
from planner.core.plans import Expr, Load

log = logging.getLogger(__name__)

GEMM_SIZES = (256, 512, 1024)


@dataclass(frozen=True)
class Calibration:
    """What was measured (rates in GB/s, GFLOP/s, µs) and how long it took."""

    triad_gbps: float
    launch_us: float
    gemm_gflops: dict[int, float]
    tiled_gemm_gflops: float
    vector_gflops: float
    cpu: str
    seconds: float

    def spec(self, name: str = "cpu-calibrated") -> DeviceSpec:
        peak = max(self.gemm_gflops.values()) / 1e3
        eff = min(1.0, self.tiled_gemm_gflops / self.gemm_gflops[max(self.gemm_gflops)])
        gemm = ", ".join(f"{n}: {g:.1f}" for n, g in self.gemm_gflops.items())
        threads = os.environ.get("FUSION_PLANNER_BLAS_THREADS") or "1"
        return DeviceSpec(
            name=name,
            bandwidth_gbps=round(self.triad_gbps, 3),
            matmul_tflops={d: round(peak, 6) for d in ("fp16", "bf16", "fp32")},
            vector_tflops=round(self.vector_gflops / 1e3, 6),
            launch_us=round(self.launch_us, 4),
            sm_count=os.cpu_count() or 1,
            gemm_efficiency={"cublaslt": round(eff, 4), "custom": round(eff, 4)},
            source=(
                f"fusion-planner calibrate --backend cpu on {self.cpu} ({platform.machine()}, "
                f"{os.cpu_count()} CPUs), {datetime.date.today().isoformat()}: triad {self.triad_gbps:.2f} GB/s, "
                f"empty kernel {self.launch_us:.3f} us, GEMM GFLOP/s {{{gemm}}} on {threads} BLAS thread(s), row-tiled "
                f"{self.tiled_gemm_gflops:.1f}, vector {self.vector_gflops:.2f} GFLOP/s"
            ),
        )


def _samples_us(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return samples


def _best_us(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Throughput benchmarks report their best run (as STREAM does): other load only slows a run."""
    return min(_samples_us(fn, repeats, warmup))


def _median_us(fn: Callable[[], None], repeats: int, warmup: int = 1) -> float:
    return statistics.median(_samples_us(fn, repeats, warmup))


def _generated(body: Expr) -> CKernel:
    """The kernel of ``body`` (fp32 1-D: each tensor it loads has the body's shape)."""
    loads = sorted({a.tensor for e in body.walk() for a in e.args if isinstance(a, Load)})
    return generate(body, {n: (tuple(body.type.shape), "fp32") for n in loads})


def _kernel(body: Expr, arrays: dict[str, np.ndarray], out: np.ndarray) -> Callable[[], None]:
    """Generate, compile and bind the kernel of ``body`` over ``arrays`` (:func:`_generated`)."""

    ck = _generated(body)
    fn = Compiler().function(ck.source, len(ck.params) + 1)
    args = (*(arrays[p.tensor].ctypes.data for p in ck.params if p.tensor is not None), out.ctypes.data, 0, ck.rows, ck.cols)
    return lambda: fn(*args)


def _affine(x: Expr | Load, a: float, b: float, n: int) -> Expr:
    return Expr("Affine", (x,), (("a", a), ("b", b)), "", TensorType((n,), "fp32"))


def _triad_body(n: int) -> Expr:
    return Expr("Add", (Load("b"), _affine(Load("c"), 3.0, 0.0, n)), (), "", TensorType((n,), "fp32"))


def triad_gbps(n: int) -> float:
    fill_b, fill_c = 0.5, -0.25  # values do not matter (drawing 2n took 0.4 s); b + 3 * c is exact in fp32
    b, c = np.full(n, fill_b, np.float32), np.full(n, fill_c, np.float32)
    a = np.zeros(n, np.float32)
    us = _best_us(_kernel(_triad_body(n), {"b": b, "c": c}, a), repeats=7, warmup=2)
    # exact: a min and a max check every element (np.allclose's temporaries, fresh memory, took 0.07-0.78 s of a
    # cold first plan on a VM, where page faults are slow)
    if not float(a.min()) == float(a.max()) == fill_b + 3 * fill_c:
        raise RuntimeError("triad kernel computed a wrong result")
    return 3 * 4 * n / (us * 1e-6) / 1e9


def launch_us(calls: int = 2000) -> float:

    fn = Compiler().function(noop_source(), 2)
    buf = np.zeros(1, np.float32)
    args = (buf.ctypes.data, buf.ctypes.data, 0, 1, 1)

    def step() -> None:  # the shape of a plan step: a closure calling the bound kernel
        fn(*args)

    def batch() -> None:
        for _ in range(calls):
            step()

    return _median_us(batch, repeats=5) / calls


def gemm_gflops(n: int) -> float:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), np.float32)
    us = _best_us(lambda: np.matmul(a, b, out=out), repeats=7)
    return 2.0 * n**3 / (us * 1e-6) / 1e9


def tiled_gemm_gflops(n: int) -> float:
    """The CPU backend's GEMM route: BLAS on row tiles sized to a quarter of the cache."""

    rows = gemm_tile_rows(n, n, n, cache_bytes()[0] // 4)
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    tile = np.empty((rows, n), np.float32)

    def run() -> None:
        for r in range(0, n, rows):
            r1 = min(n, r + rows)
            np.matmul(a[r:r1], b, out=tile[: r1 - r])

    us = _best_us(run, repeats=7)
    return 2.0 * n**3 / (us * 1e-6) / 1e9


def _vector_body(n: int, stages: int) -> Expr:
    body: Expr | Load = Load("x")
    for s in range(stages):
        body = _affine(body, 1.0 + 1e-3 * s, -1e-3 * s, n)
    assert isinstance(body, Expr)
    return body


def vector_gflops(n: int = 8192, stages: int = 16, calls: int = 200) -> float:
    x = np.random.default_rng(3).standard_normal(n, dtype=np.float32)
    out = np.zeros(n, np.float32)
    fn = _kernel(_vector_body(n, stages), {"x": x}, out)

    def batch() -> None:
        for _ in range(calls):
            fn()

    us = _best_us(batch, repeats=5) / calls
    return 2.0 * stages * n / (us * 1e-6) / 1e9


def calibrate_cpu(*, triad_n: int = 1 << 23, gemm_sizes: tuple[int, ...] = GEMM_SIZES) -> Calibration:
    """Run the microbenchmarks (about 3-5 s at the defaults on a 2-core machine).

    GEMMs run with the BLAS thread count the CPU backend uses (``FUSION_PLANNER_BLAS_THREADS``).
    """

    t0 = time.perf_counter()
    # the generated kernels in one compiler run (each alone costs a compiler start), the streaming probe's too (a
    # plan's first search on this machine measures with them next), compiled while the GEMMs are timed
    compiled = Compiler().start_many([*(_generated(body).source for body in (_triad_body(triad_n), _vector_body(8192, 16))),
                                      noop_source(), *stream_probe.kernel_sources()])
    one_core = _cores() == 1
    if one_core:  # the compiler would share the core with the GEMMs timed next (a 1024 GEMM measured at half its
        compiled()  # rate): it finishes first, in the same total time
    with limit_blas_threads(blas_threads_from_env()):
        gemm = {n: gemm_gflops(n) for n in gemm_sizes}
        tiled = tiled_gemm_gflops(max(gemm_sizes))
    if not one_core:
        compiled()
    cal = Calibration(
        triad_gbps=triad_gbps(triad_n),
        launch_us=launch_us(),
        gemm_gflops=gemm,
        tiled_gemm_gflops=tiled,
        vector_gflops=vector_gflops(),
        cpu=cpu_model(),
        seconds=0.0,
    )
    cal = dataclasses.replace(cal, seconds=time.perf_counter() - t0)
    log.info("calibration took %.1f s", cal.seconds)
    return cal


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


#: the kernel cache's record of this machine's calibrated spec (:func:`machine_spec`)
MACHINE_SPEC_FILE = "device-cpu.json"


def _machine_key() -> dict[str, Any]:
    """What a recorded calibration holds for: the CPU, its core count, numpy and the BLAS threads GEMMs ran on."""
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "numpy": np.__version__,
            "blas_threads": os.environ.get("FUSION_PLANNER_BLAS_THREADS") or "1"}


def record_machine_spec(spec: DeviceSpec) -> None:
    """Keep ``spec`` as this machine's calibrated spec (what ``fusion-planner calibrate --backend cpu`` refreshes)."""
    keep_record(cache_dir() / MACHINE_SPEC_FILE, {"key": _machine_key(), "spec": spec.to_json()}, "the calibration")


@functools.cache
def machine_spec() -> DeviceSpec:
    """This machine's calibrated spec, the one a cpu search is costed with unless told otherwise: read from the
    kernel cache, else measured once (a few seconds) and kept there."""
    path = cache_dir() / MACHINE_SPEC_FILE
    record = read_record(path, _machine_key())
    try:
        if record is not None:
            return device_from_json(record.get("spec"), str(path))
    except DeviceSpecError as exc:
        log.debug("no usable calibration in %s (%s): measuring this machine", path, exc)
    log.info("calibrating this machine once for the cost model (a few seconds; `fusion-planner calibrate` refreshes it)")
    spec = calibrate_cpu().spec()
    record_machine_spec(spec)
    return spec

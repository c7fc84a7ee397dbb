"""GPU calibration through the remote path: measured there (cupy only), turned into a DeviceSpec here.

There: ``python -m backends.cupy calibrate -o calibration.json`` measures

* launch overhead: back-to-back launches of an empty ``RawKernel`` between two CUDA events, per launch (what a
  plan of many small kernels pays on the device) and, separately, the host's time per launch call;
* copy bandwidth: device-to-device copies at three sizes, bytes counted as the byte ledger counts a copy (one
  read and one write per byte);
* GEMM throughput: ``cupy.matmul`` (cuBLAS) at three square sizes in fp16 and fp32.

Here: ``fusion-planner calibrate --from-measured calibration.json --base h200 -o h200-measured.json`` keeps the
base spec's datasheet peaks and architecture limits and replaces what was measured: the bandwidth (best copy
rate), the launch overhead, the SM count and the library GEMMs' efficiency (best measured fp16 rate over the
datasheet peak).  The custom kernels' efficiency stays the base's: nothing here times them.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from planner.backend import BackendUnavailable
from planner.core.cost import DeviceSpec, DeviceSpecError
from planner.core.files import read_json

SCHEMA = "fusion-planner/gpu-calibration/1"
COPY_MIB = (64, 512, 2048)
GEMM_SIZES = (2048, 4096, 8192)
GEMM_DTYPES = ("fp16", "fp32")
LAUNCHES = 2000


def measure(copy_mib: tuple[int, ...] = COPY_MIB, gemm_sizes: tuple[int, ...] = GEMM_SIZES,
            launches: int = LAUNCHES) -> dict[str, Any]:
    """Run the microbenchmarks on the current CUDA device; the measured-file JSON."""
    try:
        import cupy as cp  # optional dependency: only on a GPU machine

        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    except (ImportError, RuntimeError) as exc:  # CUDARuntimeError is a RuntimeError
        raise BackendUnavailable(f"calibrating needs cupy and a CUDA device: {exc}") from None
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    stream = cp.cuda.Stream(non_blocking=True)

    from backends.cupy.gpu import event_times  # needs cupy, present here

    def event_us(fn: Callable[[], None], repeats: int = 5) -> float:
        return statistics.median(event_times(fn, stream, 1, repeats))

    empty = cp.RawKernel('extern "C" __global__ void fp_empty() {}', "fp_empty")

    def burst() -> None:
        for _ in range(launches):
            empty((1,), (32,), ())

    t0 = time.perf_counter()
    launch_us = event_us(burst) / launches
    host_us = (time.perf_counter() - t0) / (6 * launches) * 1e6  # six bursts in event_us
    copies = {}
    for mib in copy_mib:
        with stream:  # filled on the timed stream: a non-blocking stream is not ordered after the default one
            src = cp.ones(mib * 2**20 // 4, dtype=cp.float32)
            dst = cp.empty_like(src)

        def copy(src: Any = src, dst: Any = dst) -> None:
            cp.copyto(dst, src)

        copies[str(mib)] = 2 * src.nbytes / event_us(copy) / 1e3
        del src, dst
    gemm: dict[str, dict[str, float]] = {}
    for dtype in GEMM_DTYPES:
        np_dtype = cp.float16 if dtype == "fp16" else cp.float32
        gemm[dtype] = {}
        for n in gemm_sizes:
            with stream:
                a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(np_dtype)
                b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(np_dtype)
                out = cp.empty((n, n), dtype=np_dtype)

            def product(a: Any = a, b: Any = b, out: Any = out) -> None:
                cp.matmul(a, b, out=out)

            us = event_us(product)
            gemm[dtype][str(n)] = 2 * n**3 / us / 1e6  # TFLOP/s
            del a, b, out
    return {
        "schema": SCHEMA,
        "device": name,
        "sm_count": int(props["multiProcessorCount"]),
        "cc": f"{props['major']}.{props['minor']}",
        "driver": int(cp.cuda.runtime.driverGetVersion()),
        "cupy": cp.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "launch_us": round(launch_us, 3),
        "host_launch_us": round(host_us, 3),
        "copy_gbps": {k: round(v, 1) for k, v in copies.items()},
        "gemm_tflops": {d: {k: round(v, 2) for k, v in g.items()} for d, g in gemm.items()},
    }


def _positive(data: Mapping[str, Any], key: str, source: str) -> float:
    value = data.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise DeviceSpecError(f"calibration file {source}: {key!r} must be a positive number, got {value!r}")
    return float(value)


def _rates(data: Mapping[str, Any], key: str, source: str) -> dict[str, float]:
    table = data.get(key)
    if not isinstance(table, dict) or not table:
        raise DeviceSpecError(f"calibration file {source}: {key!r} must be a non-empty object of size -> rate")
    return {str(k): _positive(table, k, f"{source} {key}") for k in table}


def spec_from_measured(data: Any, base: DeviceSpec, source: str = "<json>", name: str | None = None) -> DeviceSpec:
    """``base`` with the measured bandwidth, launch overhead, SM count and library GEMM efficiency."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise DeviceSpecError(f"calibration file {source}: not a GPU calibration (schema {SCHEMA!r} expected)")
    copy = _rates(data, "copy_gbps", source)
    gemm = data.get("gemm_tflops")
    if not isinstance(gemm, dict) or "fp16" not in gemm:
        raise DeviceSpecError(f"calibration file {source}: 'gemm_tflops' must hold an 'fp16' table")
    fp16 = _rates(gemm, "fp16", source)
    peak = base.matmul_tflops.get("fp16")
    if not peak:
        raise DeviceSpecError(f"base spec {base.name!r} has no fp16 GEMM peak to measure efficiency against")
    best16 = max(fp16.values())
    if best16 > 1.05 * peak:
        raise DeviceSpecError(f"calibration file {source}: fp16 GEMM {best16:.0f} TFLOP/s exceeds the "
                              f"{base.name} peak {peak:.0f}: the file is from another device")
    efficiency = dict(base.gemm_efficiency, cublaslt=round(min(1.0, best16 / peak), 3))
    return dataclasses.replace(
        base,
        name=name or f"{base.name}-measured",
        bandwidth_gbps=round(max(copy.values()), 1),
        launch_us=_positive(data, "launch_us", source),
        sm_count=int(_positive(data, "sm_count", source)),
        gemm_efficiency=efficiency,
        source=(f"measured on {data.get('device', '?')} {data.get('date', '?')} ({source}): copy bandwidth, launch "
                f"overhead, SM count, cuBLAS fp16 efficiency; peaks and limits from {base.name} ({base.source})"),
    )


def load_measured_file(path: str) -> Any:
    return read_json(Path(path), DeviceSpecError, "calibration file", limit=2**20)

"""The CUDA executor: generated kernels through ``cupy.RawKernel``, GEMMs through cuBLASLt.

Only imported where cupy exists (``--executor cupy``, ``CupyBackend``).
Compilation, cuBLASLt planning and allocation happen in ``prepare``; the timed
region holds only kernel launches and library executions, bracketed by CUDA
events.  Kernel facts come from the compiled kernel (registers, local memory)
and the driver's occupancy API.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.cupy.bundle import BundleKernel, Candidate, CublasCall
from backends.cupy.kernel import CudaKernel
from backends.cupy.nvrtc import compile_options
from planner.backend import BackendUnavailable
from planner.core.dtypes import numpy_dtype
from planner.core.kinds import KernelKind

try:
    import cupy as cp
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise BackendUnavailable(f"the cupy executor needs cupy: {exc}") from None

log = logging.getLogger(__name__)

def _device_name() -> str:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def device_dtype(dtype: str) -> Any:
    """cupy storage dtype; bf16 travels as its 16 bits (cupy has no bfloat16)."""
    return np.dtype(np.uint16) if dtype == "bf16" else numpy_dtype(dtype)


def to_device(arr: np.ndarray, dtype: str) -> Any:
    host = np.asarray(arr).astype(numpy_dtype(dtype))
    return cp.asarray(host.view(np.uint16) if dtype == "bf16" else host)


def to_host(buf: Any, dtype: str) -> np.ndarray:
    host = cp.asnumpy(buf)
    return (host.view(numpy_dtype(dtype)) if dtype == "bf16" else host).astype(np.float32)


def sm_count() -> int:
    return int(cp.cuda.Device().attributes["MultiProcessorCount"])


def raw_kernel(k: CudaKernel) -> Any:
    kern = cp.RawKernel(k.source, k.name, options=compile_options())  # crt/ from the carried wheel (nvrtc.py)
    kern.compile()
    return kern


def compiled_facts(kern: Any, block: int) -> dict[str, Any]:
    """Registers and local memory of a compiled RawKernel; occupancy from the driver."""
    facts: dict[str, Any] = {
        "regs": int(kern.num_regs),
        "spill_bytes": int(kern.local_size_bytes),
        "local_bytes": int(kern.local_size_bytes),
        "smem_bytes": int(kern.shared_size_bytes),
        "block": block,
        "facts_from": "cupy RawKernel attributes + cuOccupancyMaxActiveBlocksPerMultiprocessor",
    }
    facts["occupancy"] = int(cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, block, 0))
    return facts


# ---------------------------------------------------------------- cuBLASLt


class CublasLtGemm:
    """One planned cuBLASLt matmul with an epilogue (nvmath-python's stateful ``Matmul``).

    cuBLASLt's bias has one entry per row of its column-major result, while our
    BiasAdd adds one entry per column of the row-major ``D(M,N)``.  So the
    library computes ``D^T(N,M) = B^T @ A^T`` (row-major D is column-major D^T,
    and the transposes are free views): its bias then has length N, as ours.

    The result is written in place into the plan's own ``D`` buffer (``c = D^T``, ``beta = 0``,
    ``MatmulOptions.inplace``), so ``execute`` allocates nothing inside the timed region and the
    result has our layout.  Where the library refuses that, it allocates a result per call as
    before; the kernel's facts then say ``preallocated: false``.
    """

    def __init__(self, call: CublasCall, bufs: Mapping[str, Any], out: str, stream: Any) -> None:
        if call.dtype == "bf16":
            raise RuntimeError("cuBLASLt bf16 is not timed: cupy has no bfloat16 dtype to hand to nvmath-python")
        from nvmath.linalg.advanced import Matmul, MatmulEpilog

        self.call, self.stream, self.bufs, self.out = call, stream, bufs, out
        self.a, self.b = bufs[call.a], bufs[call.b]
        # nvmath's bias is a column of the result: shape (rows, 1); ours is (N,), so a free reshape
        inputs = {"bias": bufs[call.bias].reshape(-1, 1)} if call.bias else None
        # "no epilogue" is epilog=None: nvmath's handler map has no DEFAULT and asserts on it
        epilog = None if call.epilogue == "DEFAULT" else MatmulEpilog[call.epilogue]
        try:
            self.mm = Matmul(self.b.T, self.a.T, c=bufs[out].T, beta=0.0, options={"inplace": True}, stream=stream)
            self.mm.plan(epilog=epilog, epilog_inputs=inputs, stream=stream)
            self.preallocated = True
        except Exception as exc:  # any refusal of the in-place form: plan the allocating one
            log.warning("cuBLASLt %s: no in-place result (%s); a result is allocated per call", call.epilogue, exc)
            self.mm = Matmul(self.b.T, self.a.T, stream=stream)
            self.mm.plan(epilog=epilog, epilog_inputs=inputs, stream=stream)
            self.preallocated = False
        self.layout_copy = False

    def __call__(self) -> Any:
        if self.preallocated:
            self.mm.execute(stream=self.stream)
            return self.bufs[self.out]
        a, b = self.bufs[self.call.a], self.bufs[self.call.b]
        if a is not self.a or b is not self.b:  # an upstream library call returned a new array
            self.a, self.b = a, b
            self.mm.reset_operands(a=b.T, b=a.T, stream=self.stream)
        r = self.mm.execute(stream=self.stream).T
        if not r.flags.c_contiguous:  # the library chose the other layout: pay (and report) a copy
            self.layout_copy = True
            r = cp.ascontiguousarray(r)
        return r

    def close(self) -> None:
        """Free the library's plan; a refusal is logged, not raised: the timings already taken stand, and the
        handle is held until the process ends."""
        try:
            self.mm.free()
        except Exception as exc:  # nvmath logs its own "only part ... released" line too
            log.warning("cuBLASLt %s plan not freed (%s): its workspace stays allocated until the process ends",
                        self.call.epilogue, exc)


# ---------------------------------------------------------------- a prepared plan


@dataclass
class CupyPrepared:
    cand: Candidate
    bufs: dict[str, Any]
    steps: list[Callable[[], None]]
    outputs: tuple[str, ...]
    stream: Any
    kernel_facts: list[dict[str, Any]] = field(default_factory=list)
    gemms: list[CublasLtGemm] = field(default_factory=list)

    def launch(self) -> None:
        for step in self.steps:
            step()

    def close(self) -> None:
        """Free the cuBLASLt plans (nvmath ``Matmul`` handles hold library and device resources)."""
        for g in self.gemms:
            g.close()
        self.gemms = []

    def run(self) -> list[np.ndarray]:
        with self.stream:
            self.launch()
        self.stream.synchronize()
        for g, f in zip(self.gemms, [f for f in self.kernel_facts if f.get("kind") == KernelKind.CUBLASLT], strict=True):
            f["layout_copy"] = g.layout_copy
        return [to_host(self.bufs[o], self.cand.plan.tensors[o].dtype) for o in self.outputs]

    def time(self, warmup: int, repeats: int) -> list[float]:
        return event_times(self.launch, self.stream, warmup, repeats, before=l2_flusher(self.stream))

    def time_graph(self, warmup: int, repeats: int) -> float | None:
        """Median µs of the whole plan replayed as one captured CUDA graph (None if capture fails)."""
        try:
            with self.stream:
                self.stream.begin_capture()
                self.launch()
                graph = self.stream.end_capture()
        except Exception as exc:  # capture is optional: report why it was not measured
            log.warning("CUDA graph capture failed for %s: %s", self.cand.plan.notation(), exc)
            if self.stream.is_capturing():
                self.stream.end_capture()
            return None
        replay = event_times(lambda: graph.launch(self.stream), self.stream, warmup, repeats, before=l2_flusher(self.stream))
        # nvmath records each execution's event as the one its free() waits on; one recorded during the capture
        # is no event outside it (CUDA_ERROR_INVALID_VALUE on the H200), so run the plan once more, uncaptured
        with self.stream:
            self.launch()
        self.stream.synchronize()
        return round(statistics.median(replay), 3)

    def time_steps(self, repeats: int) -> list[float]:
        """Median µs of each step (a kernel or a library call) within whole runs: an event after each step, the
        L2 flushed before each run. A step the GPU finished before the host launched the next one also counts
        the host's launch gap, as it does in the run."""
        flush = l2_flusher(self.stream)
        samples: list[list[float]] = [[] for _ in self.steps]
        with self.stream:
            for _ in range(repeats):
                flush()
                events = [cp.cuda.Event() for _ in range(len(self.steps) + 1)]
                events[0].record(self.stream)
                for step, done in zip(self.steps, events[1:], strict=True):
                    step()
                    done.record(self.stream)
                events[-1].synchronize()
                for i, got in enumerate(samples):
                    got.append(cp.cuda.get_elapsed_time(events[i], events[i + 1]) * 1e3)
        return [round(statistics.median(s), 3) for s in samples]


def l2_flusher(stream: Any) -> Callable[[], None]:
    """A memset of twice the device's L2 cache on ``stream``: enqueued before each timed run (outside its events),
    it leaves no input or weight of the previous run in L2 (the H200's 60 MiB L2 holds the decode GEMM's 33.5 MB
    weight, so back-to-back runs would read it from cache and time an optimistic decode)."""
    size = 2 * int(cp.cuda.Device().attributes["L2CacheSize"])
    scratch = cp.empty(max(size, 1), dtype=cp.uint8)

    def flush() -> None:
        with stream:
            scratch.fill(0)

    return flush


def event_times(fn: Callable[[], None], stream: Any, warmup: int, repeats: int,
                before: Callable[[], None] | None = None) -> list[float]:
    """µs per call of ``fn`` between two CUDA events, one sample per repeat; ``before`` (an L2 flush) is enqueued
    ahead of each timed call, outside its events."""
    with stream:
        for _ in range(warmup):
            fn()
        stream.synchronize()
        samples = []
        for _ in range(repeats):
            if before is not None:
                before()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            samples.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return samples


def _launcher(kern: Any, k: CudaKernel, bufs: dict[str, Any], sms: int) -> Callable[[], None]:
    grid = k.grid_for(sms)
    for p in k.params[:-1]:
        if not bufs[p].flags.c_contiguous:
            raise RuntimeError(f"kernel {k.name} reads a non-contiguous buffer")

    def step() -> None:
        kern(grid, (k.block,), tuple(bufs[p] for p in k.params))

    return step


def _gemm_step(g: CublasLtGemm, out: str, bufs: dict[str, Any]) -> Callable[[], None]:
    def step() -> None:
        bufs[out] = g()

    return step


class CupyExecutor:
    name = "cupy"

    def __init__(self) -> None:
        try:
            self.sms = sm_count()
        except cp.cuda.runtime.CUDARuntimeError as exc:  # cupy present, no usable device or driver
            raise BackendUnavailable(f"cupy found no usable CUDA device: {exc}") from None
        self._kernels: dict[str, Any] = {}

    def machine(self) -> dict[str, Any]:
        return {
            "executor": "cupy",
            "device": _device_name(),
            "sm_count": self.sms,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "cupy": cp.__version__,
        }

    def kernel(self, k: CudaKernel) -> Any:
        if k.digest not in self._kernels:
            self._kernels[k.digest] = raw_kernel(k)
        return self._kernels[k.digest]

    def prepare(self, cand: Candidate, inputs: Mapping[str, np.ndarray]) -> CupyPrepared:
        plan = cand.plan
        stream = cp.cuda.Stream(non_blocking=True)
        bufs: dict[str, Any] = {}
        with stream:
            for name, arr in inputs.items():
                bufs[name] = to_device(arr, plan.tensors[name].dtype)
            for bk in cand.kernels:
                t = plan.tensors[bk.kernel.out]
                bufs[bk.kernel.out] = cp.empty(t.shape, dtype=device_dtype(t.dtype))
        prepared = CupyPrepared(cand, bufs, [], plan.outputs, stream)
        for bk in cand.kernels:
            prepared.steps.append(self._step(bk, prepared))
        stream.synchronize()
        return prepared

    def _step(self, bk: BundleKernel, prepared: CupyPrepared) -> Callable[[], None]:
        if bk.cuda is not None:
            kern = self.kernel(bk.cuda)
            prepared.kernel_facts.append({"kind": bk.kernel.kind, "name": bk.cuda.name, **compiled_facts(kern, bk.cuda.block)})
            return _launcher(kern, bk.cuda, prepared.bufs, self.sms)
        if bk.cublas is not None:
            g = CublasLtGemm(bk.cublas, prepared.bufs, bk.kernel.out, prepared.stream)
            prepared.gemms.append(g)
            prepared.kernel_facts.append({"kind": KernelKind.CUBLASLT, "epilogue": bk.cublas.epilogue,
                                          "preallocated": g.preallocated})
            return _gemm_step(g, bk.kernel.out, prepared.bufs)
        raise RuntimeError(bk.unsupported or f"kernel {bk.kernel.describe()} has no GPU form")


def d2d_copy_us(nbytes: int, warmup: int = 2, repeats: int = 7) -> float:
    """Median µs of one ``cudaMemcpyAsync`` device-to-device copy of ``nbytes``."""
    src = cp.empty(nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    stream = cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime

    def copy() -> None:
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, stream.ptr)

    return statistics.median(event_times(copy, stream, warmup, repeats))

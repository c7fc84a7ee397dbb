"""The CPU backend: generated C kernels, BLAS GEMMs fused with their epilogues by row tiles.

Every stored tensor of a plan gets its own buffer, in its stored dtype (fp32 as
``float32``, fp16/bf16 as ``uint16`` bit patterns), allocated at compile time
and reused by every run.  Each kernel becomes one step:

* ``elementwise``: one generated C loop nest (``fusion_planner.backends.cpu.codegen``);
* ``gemm_epilogue`` and ``cublaslt``: for each tile of rows, numpy/BLAS computes
  the fp32 GEMM tile into a scratch buffer sized to a quarter of the L2 cache,
  then the generated epilogue loop reads that tile while it is hot and stores
  the kernel's output.  The full GEMM result never exists in memory.  (A
  ``cublaslt`` kernel is the CPU's library-GEMM-with-epilogue: the same route.)
* ``opaque``: the registered numpy implementation (the reference's).

Each step knows the buffers it reads and writes; ``kernel_facts[i]["bytes_moved"]``
is their byte count, each tensor counted once per kernel, as the cost model's
byte ledger counts them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from fusion_planner.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    CompiledPlan,
    Timing,
    collect_samples,
)
from fusion_planner.backends.codegen import find_matmul
from fusion_planner.backends.cpu.codegen import (
    CKernel,
    CodegenError,
    Compiler,
    CompilerUnavailable,
    generate,
    rows_cols,
    widen_source,
)
from fusion_planner.backends.reference import eval_expr
from fusion_planner.core.cost import DeviceSpec
from fusion_planner.core.graph import TensorType
from fusion_planner.core.kinds import KernelKind
from fusion_planner.core.ops import DTYPE_BYTES, numpy_dtype
from fusion_planner.core.plans import Kernel, Plan

log = logging.getLogger(__name__)

#: used when the cache size cannot be read (bytes): a common L3 slice
DEFAULT_CACHE_BYTES = 8 << 20
#: BLAS threads while a plan runs (``FUSION_PLANNER_BLAS_THREADS`` overrides; 0 = the library's default).
#: One, like the generated loops: with every core's thread in one GEMM, a single busy core
#: (another process) stalls the whole GEMM; a 256^3 GEMM took 12-16 ms on 2 threads against
#: 0.3 ms on 1 while two other processes ran on this 2-core machine.
DEFAULT_BLAS_THREADS = 1


def blas_threads_from_env() -> int | None:
    raw = os.environ.get("FUSION_PLANNER_BLAS_THREADS", "").strip()
    if not raw:
        return DEFAULT_BLAS_THREADS
    try:
        n = int(raw)
    except ValueError:
        raise BackendError(f"FUSION_PLANNER_BLAS_THREADS must be an integer, got {raw!r}") from None
    if n < 0:
        raise BackendError(f"FUSION_PLANNER_BLAS_THREADS must be >= 0, got {n}")
    return n or None


def limit_blas_threads(n: int | None, controller: Any = None) -> contextlib.AbstractContextManager[Any]:
    """Limit BLAS to ``n`` threads inside the block (``None``: leave it alone).

    ``controller`` (a ``threadpoolctl.ThreadpoolController``) knows the BLAS
    libraries loaded when it was made; by default a new one is made.
    """
    if n is None:
        return contextlib.nullcontext()
    if controller is None:

        controller = ThreadpoolController()
    return controller.limit(limits=n, user_api="blas")


# ---------------------------------------------------------------- storage


def storage_dtype(dtype: str) -> np.dtype:
    """How a tensor of ``dtype`` lies in memory: fp32 as float32, 16-bit types as uint16 bits."""
    return np.dtype(np.float32) if DTYPE_BYTES[dtype] == 4 else np.dtype(np.uint16)


def to_storage(x: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Round ``x`` to ``dtype`` and write its bit pattern into ``out``."""
    rounded = np.asarray(x, dtype=np.float32).astype(numpy_dtype(dtype))
    out[...] = rounded.view(out.dtype) if rounded.dtype != out.dtype else rounded


def from_storage(buf: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of a stored tensor (a view for fp32, a conversion otherwise)."""
    if buf.dtype == np.float32:
        return buf
    return buf.view(numpy_dtype(dtype)).astype(np.float32)


def cache_bytes() -> tuple[int, str]:
    """Size of the last-level data cache (bytes) and where the figure came from.

    Read from sysfs (the largest Data/Unified level of cpu0), else ``os.sysconf``
    (L3, then L2), else :data:`DEFAULT_CACHE_BYTES`.  The last level, not L2:
    BLAS repacks the B operand on every call, so tiles of a few dozen rows (what
    a quarter of a 1 MiB L2 allows at N=K=1024) cost more GEMM throughput than
    fusion saves; a quarter of L3 still keeps the tile out of DRAM.
    """
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        for entry in sorted(os.listdir(base)):
            if not entry.startswith("index"):
                continue
            with open(f"{base}/{entry}/type") as f:
                kind = f.read().strip()
            with open(f"{base}/{entry}/size") as f:
                size = f.read().strip()
            if kind in ("Unified", "Data"):
                mult = {"K": 1024, "M": 1 << 20}.get(size[-1], 1)
                best = max(best, int(size.rstrip("KM")) * mult)
    except (OSError, ValueError):
        best = 0
    if best:
        return best, "sysfs"
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            v = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if v and v > 0:
            return int(v), f"sysconf {name}"
    return DEFAULT_CACHE_BYTES, "default"


def gemm_tile_rows(rows: int, cols: int, kdim: int, tile_bytes: int) -> int:
    """Rows per GEMM tile: the fp32 tile plus the fp32 rows of A it comes from fit ``tile_bytes``."""
    return max(1, min(rows, tile_bytes // (4 * (cols + kdim))))


# ---------------------------------------------------------------- steps


@dataclass
class Step:
    """One kernel ready to run: ``call()`` executes it on the plan's buffers."""

    kernel: Kernel
    call: Callable[[], None]
    reads: list[np.ndarray]
    writes: np.ndarray
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_moved(self) -> int:
        return sum(b.nbytes for b in self.reads) + self.writes.nbytes


class CpuCompiledPlan(CompiledPlan):
    def __init__(
        self,
        plan: Plan,
        steps: list[Step],
        buffers: dict[str, np.ndarray],
        inputs: list[str],
        compile_s: float,
        threads: int | None,
        controller: Any,
    ):
        super().__init__(plan, [dict(s.facts, bytes_moved=s.bytes_moved) for s in steps], compile_s)
        self.steps = steps
        self.buffers = buffers
        self.input_names = inputs
        self.threads = threads
        self.controller = controller
        self._loaded: dict[str, np.ndarray] = {}  # the array last copied into each input buffer
        self.loads = 0  # inputs copied into buffers so far (tests count them)

    def _load_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        for name in self.input_names:
            if name not in inputs:
                raise BackendError(f"missing input {name!r}")
            ttype = self.plan.tensors[name]
            arr = np.asarray(inputs[name])
            if self._loaded.get(name) is arr and not arr.flags.writeable:
                continue  # the same read-only array as last time (a bound parameter): already in its buffer
            if tuple(arr.shape) != tuple(ttype.shape):
                raise BackendError(f"input {name!r} has shape {list(arr.shape)}, expected {list(ttype.shape)}")
            to_storage(arr, ttype.dtype, self.buffers[name])
            self.loads += 1
            self._loaded[name] = arr

    def _execute(self) -> None:
        for s in self.steps:
            s.call()

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        self._load_inputs(inputs)
        with limit_blas_threads(self.threads, self.controller):
            self._execute()
        return [np.array(from_storage(self.buffers[o], self.plan.tensors[o].dtype)) for o in self.plan.outputs]

    def time(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        warmup: int = 2,
        repeats: int = 7,
        stop_if: Callable[[float], bool] | None = None,
    ) -> Timing:
        self._load_inputs(inputs)

        def measure_us() -> float:
            t0 = time.perf_counter_ns()
            self._execute()
            return (time.perf_counter_ns() - t0) / 1e3

        with limit_blas_threads(self.threads, self.controller):
            return collect_samples(measure_us, warmup=warmup, repeats=repeats, stop_if=stop_if)


class CpuBackend(Backend):
    name = "cpu"
    measures = True

    def __init__(
        self,
        spec: DeviceSpec,
        compiler: Compiler | None = None,
        tile_bytes: int | None = None,
        blas_threads: int | None | str = "env",
    ) -> None:
        """``blas_threads``: threads BLAS may use while a plan runs (None: the library's
        default; "env": ``FUSION_PLANNER_BLAS_THREADS``, else :data:`DEFAULT_BLAS_THREADS`)."""
        super().__init__(spec)
        self.blas_threads: int | None = (
            blas_threads_from_env() if isinstance(blas_threads, str) else blas_threads
        )

        self.controller = ThreadpoolController()  # numpy's BLAS is loaded by now
        try:
            self.compiler = compiler or Compiler()
        except CompilerUnavailable as exc:
            raise BackendUnavailable(str(exc)) from None
        if tile_bytes is None:
            size, origin = cache_bytes()
            tile_bytes = size // 4
            log.info("GEMM tiles up to %d bytes (a quarter of %d, from %s)", tile_bytes, size, origin)
        self.tile_bytes = tile_bytes

    # -- compile
    def compile(self, plan: Plan) -> CpuCompiledPlan:
        t0 = time.perf_counter()
        written = [k.out for k in plan.kernels]
        if len(set(written)) != len(written):
            raise BackendError("plan writes one tensor from two kernels")
        read = {r for k in plan.kernels for r in k.reads}
        inputs = sorted((read | set(plan.outputs)) - set(written))
        buffers: dict[str, np.ndarray] = {}
        for name in inputs + written:
            ttype = plan.tensors.get(name)
            if ttype is None:
                raise BackendError(f"plan has no type for tensor {name!r}")
            buffers[name] = np.zeros(ttype.shape, dtype=storage_dtype(ttype.dtype))
        steps = []
        for i, k in enumerate(plan.kernels):
            try:
                steps.append(self._step(k, plan.tensors, buffers))
            except (CodegenError, BackendError) as exc:
                raise BackendError(f"kernel {i} ({k.describe()}): {exc}") from exc
        return CpuCompiledPlan(plan, steps, buffers, inputs, time.perf_counter() - t0, self.blas_threads, self.controller)

    def _step(self, k: Kernel, tensors: Mapping[str, TensorType], buffers: dict[str, np.ndarray]) -> Step:
        # generated loops trust these shapes: a mismatch would write out of bounds
        out_t = tensors[k.out]
        if tuple(out_t.shape) != tuple(k.body.type.shape) or out_t.dtype != k.body.type.dtype:
            raise BackendError(
                f"body computes {list(k.body.type.shape)} {k.body.type.dtype} but tensor {k.out!r} "
                f"is {list(out_t.shape)} {out_t.dtype}"
            )
        if k.kind == KernelKind.ELEMENTWISE:
            return self._elementwise(k, tensors, buffers)
        if k.kind in (KernelKind.GEMM_EPILOGUE, KernelKind.CUBLASLT):
            return self._gemm(k, tensors, buffers)
        if k.kind == KernelKind.OPAQUE:
            return self._opaque(k, tensors, buffers)
        raise BackendError(f"unknown kernel kind {k.kind!r}")

    def _types(self, tensors: Mapping[str, TensorType]) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}

    def _bind(self, ck: CKernel, buffers: dict[str, np.ndarray], tile: np.ndarray | None = None) -> tuple[Callable[..., None], list[int], list[np.ndarray]]:
        fn = self.compiler.function(ck.source, len(ck.params) + 1)
        ptrs, reads = [], []
        for p in ck.params:
            if p.tensor is not None and p.tensor not in buffers:
                raise BackendError(f"kernel loads {p.tensor!r}, which is neither an input nor written by a kernel")
            buf = tile if p.tensor is None else buffers[p.tensor]
            assert buf is not None
            ptrs.append(buf.ctypes.data)
            if p.tensor is not None:
                reads.append(buf)
        return fn, ptrs, reads

    def _elementwise(self, k: Kernel, tensors: Mapping[str, TensorType], buffers: dict[str, np.ndarray]) -> Step:
        ck = generate(k.body, self._types(tensors))
        fn, ptrs, reads = self._bind(ck, buffers)
        out = buffers[k.out]
        args = (*ptrs, out.ctypes.data, 0, ck.rows, ck.cols)

        def call() -> None:
            fn(*args)

        return Step(k, call, reads, out, {"impl": "c-loop", "source_sha256": ck.digest[:16]})

    def _widen(self, buf: np.ndarray, dtype: str, max_rows: int) -> tuple[Callable[[int, int], np.ndarray], int]:
        """``widen(r0, r1)``: fp32 values of rows r0..r1 of a GEMM operand, and the scratch bytes used.

        fp32 operands are views of their buffer; 16-bit ones are converted into a
        scratch of ``max_rows`` rows by a generated kernel (numpy's fp16
        conversion is about 10x slower), the analogue of BLAS packing.
        """
        if buf.dtype == np.float32:
            return (lambda r0, r1: buf[r0:r1]), 0
        cols = buf.shape[-1]
        wide = np.empty((max_rows, cols), np.float32)
        fn = self.compiler.function(widen_source(dtype), 2)
        src, dst, row_bytes = buf.ctypes.data, wide.ctypes.data, cols * buf.itemsize

        def widen(r0: int, r1: int) -> np.ndarray:
            fn(src + r0 * row_bytes, dst, 0, r1 - r0, cols)
            return wide[: r1 - r0]

        return widen, wide.nbytes

    def _gemm(self, k: Kernel, tensors: Mapping[str, TensorType], buffers: dict[str, np.ndarray]) -> Step:
        mm = find_matmul(k.body)
        a_name, b_name = (a.tensor for a in mm.args)  # type: ignore[union-attr]
        for name in (a_name, b_name):
            if name not in buffers:
                raise BackendError(f"GEMM reads {name!r}, which is neither an input nor written by a kernel")
        a_buf, b_buf = buffers[a_name], buffers[b_name]
        rows, cols = rows_cols(tuple(k.body.type.shape))
        kdim = a_buf.shape[-1]
        if a_buf.shape != (rows, kdim) or b_buf.shape != (kdim, cols):
            raise BackendError(f"GEMM operands {list(a_buf.shape)} @ {list(b_buf.shape)} do not give {[rows, cols]}")
        tile_rows = gemm_tile_rows(rows, cols, kdim, self.tile_bytes)
        tile = np.empty((tile_rows, cols), dtype=np.float32)
        widen_a, a_scratch = self._widen(a_buf, tensors[a_name].dtype, tile_rows)
        widen_b, b_scratch = self._widen(b_buf, tensors[b_name].dtype, b_buf.shape[0])
        ck = generate(k.body, self._types(tensors), tile=mm)
        fn, ptrs, reads = self._bind(ck, buffers, tile)
        out = buffers[k.out]
        out_ptr = out.ctypes.data
        bounds = [(r, min(rows, r + tile_rows)) for r in range(0, rows, tile_rows)]
        b_rows = b_buf.shape[0]

        def call() -> None:
            b32 = widen_b(0, b_rows)
            for r0, r1 in bounds:
                np.matmul(widen_a(r0, r1), b32, out=tile[: r1 - r0])
                fn(*ptrs, out_ptr, r0, r1, cols)

        facts = {
            "impl": "blas+c-epilogue",
            "tile_rows": tile_rows,
            "tiles": len(bounds),
            "scratch_bytes": tile.nbytes + a_scratch + b_scratch,
            "blas_threads": self.blas_threads or "default",
            "source_sha256": ck.digest[:16],
        }
        return Step(k, call, [a_buf, b_buf] + [b for b in reads if b is not a_buf and b is not b_buf], out, facts)

    def _opaque(self, k: Kernel, tensors: Mapping[str, TensorType], buffers: dict[str, np.ndarray]) -> Step:
        names = list(dict.fromkeys(k.reads))
        out = buffers[k.out]
        dtype = k.body.type.dtype

        def call() -> None:
            mem = {n: from_storage(buffers[n], tensors[n].dtype) for n in names}
            value = eval_expr(k.body, mem, np.float32, {})
            if value.shape != out.shape:
                raise BackendError(f"{k.describe()} computed shape {list(value.shape)}, expected {list(out.shape)}")
            to_storage(value, dtype, out)

        return Step(k, call, [buffers[n] for n in names], out, {"impl": "numpy-reference"})

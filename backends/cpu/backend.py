"""The CPU backend: generated C kernels, BLAS GEMMs fused with their epilogues by row tiles.

Every stored tensor of a plan gets its own buffer, in its stored dtype (fp32 as
``float32``, fp16/bf16 as ``uint16`` bit patterns), allocated at compile time
and reused by every run.  Each kernel becomes one step:

* ``elementwise``: one generated C loop nest (``backends.cpu.codegen``);
* ``gemm_epilogue`` and ``cublaslt``: for each tile of rows, the GEMM library (numpy's BLAS or torch.mm) computes
  the fp32 GEMM tile into a scratch buffer sized to a quarter of the L2 cache,
  then the generated epilogue loop reads that tile while it is hot and stores
  the kernel's output.  The full GEMM result never exists in memory.  (A
  ``cublaslt`` kernel is the CPU's library-GEMM-with-epilogue: the same route.)
* ``standalone``: attention's head layouts (strided numpy copies), its batched products (the GEMM
  library's) and the fused attention kernel (generated C, ``backends.cpu.standalone``);
* ``opaque``: the registered numpy implementation (the reference's).

Each step knows the buffers it reads and writes; ``kernel_facts[i]["bytes_moved"]``
is their byte count, each tensor counted once per kernel, as the cost model's
byte ledger counts them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from backends.codegen import find_matmul, loads
from backends.cpu import gemm, native_pool, parallel, standalone
from backends.cpu.buffers import (
    HeldWeights,
    aligned_empty,
    padded_matrix,
    shared_buffers,
    typed_view,
)
from backends.cpu.codegen import (
    CKernel,
    CodegenError,
    Compiler,
    CompilerUnavailable,
    generate,
    narrow_source,
    rows_cols,
    widen_source,
)
from planner.backend import (
    Backend,
    BackendError,
    BackendUnavailable,
    CompiledPlan,
    Timing,
    collect_samples,
)
from planner.core.cost import DeviceSpec
from planner.core.dtypes import DTYPES, numpy_dtype
from planner.core.graph import TensorType
from planner.core.kinds import KernelKind
from planner.core.opaque import opaque_writer
from planner.core.ops import epilogue_has_bias
from planner.core.plans import Kernel, Load, Plan
from planner.core.reference import eval_expr

log = logging.getLogger(__name__)

#: used when the cache size cannot be read (bytes): a common L3 slice
DEFAULT_CACHE_BYTES = 8 << 20
#: BLAS threads inside one GEMM block (``FUSION_PLANNER_BLAS_THREADS`` overrides; 0 = the library's default).
#: One: a GEMM is parallel across our workers, one row block each, so BLAS threads would compete
#: with them; and with every core's thread in one BLAS call, a single busy core (another process)
#: stalls the whole GEMM (a 256^3 GEMM took 12-16 ms on 2 BLAS threads against 0.3 ms on 1 while
#: two other processes ran on this 2-core machine).
DEFAULT_BLAS_THREADS = 1


def blas_threads_from_env() -> int | None:
    """``FUSION_PLANNER_BLAS_THREADS`` (0: the library's default, returned as None), else :data:`DEFAULT_BLAS_THREADS`."""
    n = parallel.count_from_env("FUSION_PLANNER_BLAS_THREADS")
    return DEFAULT_BLAS_THREADS if n is None else (n or None)


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
    return np.dtype(np.float32) if DTYPES[dtype].bytes == 4 else np.dtype(np.uint16)


def to_storage(x: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Round ``x`` to ``dtype`` and write its bit pattern into ``out``."""
    if out.dtype == np.float32:  # fp32: one pass, no intermediate copy
        np.copyto(out, x, casting="unsafe")
        return
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


def stream_bytes_default() -> int:
    """``FUSION_PLANNER_STREAM_BYTES``, else an eighth of the last-level cache: an output that large would evict
    most of what the cache holds anyway, so it skips the cache (and the read of each line before its write)."""
    n = parallel.count_from_env("FUSION_PLANNER_STREAM_BYTES")
    return cache_bytes()[0] // 8 if n is None else n


def gemm_tile_rows(rows: int, cols: int, kdim: int, tile_bytes: int) -> int:
    """Rows per GEMM tile: the fp32 tile plus the fp32 rows of A it comes from fit ``tile_bytes``."""
    return max(1, min(rows, tile_bytes // (4 * (cols + kdim))))


# ---------------------------------------------------------------- steps


class Memory:
    """The arrays a plan's kernels read and write, by tensor name, and their addresses.

    Each tensor has a buffer of its own, allocated at compile time; a call may bind another array
    in its place (a caller's input that already has the stored layout, a fresh output array).
    Kernels look their arrays up here when they run, never at compile time."""

    def __init__(self, own: dict[str, np.ndarray], outputs: frozenset[str] = frozenset(),
                 packable: frozenset[str] = frozenset(), views: Mapping[str, str] | None = None,
                 handed: frozenset[str] = frozenset()) -> None:
        self.own = own
        self.arrays = dict(own)
        self.addr = {n: a.ctypes.data for n, a in own.items()}
        self.outputs = outputs  # tensors handed out to the caller (a fresh array each call)
        #: 16-bit weights a GEMM may multiply from oneDNN's packed form: those bound read-only have it in ``packed``
        self.packable = packable
        self.packed: dict[str, Any] = {}
        #: layout steps that copy nothing (``layout_views``): Heads results bound as views of their source, and
        #: torch attention results handed to their Merge readers as torch wrote them
        self.views: Mapping[str, str] = views or {}
        self.handed = handed
        self._arenas: dict[int, np.ndarray] = {}

    def scratch(self, slot: int, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """A work array of one kernel while it runs (a GEMM's product tile), for worker ``slot``: kernels run one
        at a time, so one arena per slot serves every kernel's and stays in cache from one to the next (a tile
        per kernel was a cold megabyte at each)."""
        need = math.prod(shape) * np.dtype(dtype).itemsize
        arena = self._arenas.get(slot)
        if arena is None or arena.nbytes < need:  # kernels compiled before keep the smaller arena they view
            arena = self._arenas[slot] = aligned_empty((need,), np.uint8)
        return typed_view(arena, shape, dtype)

    def bind(self, name: str, array: np.ndarray) -> None:
        self.arrays[name] = array
        self.addr[name] = array.ctypes.data

    def restore(self, name: str) -> None:
        self.bind(name, self.own[name])


@dataclass
class Step:
    """One kernel ready to run: ``call()`` executes it on the arrays bound in the plan's memory."""

    kernel: Kernel
    call: Callable[[], None]
    reads: list[np.ndarray]
    writes: np.ndarray
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def bytes_moved(self) -> int:
        return sum(b.nbytes for b in self.reads) + self.writes.nbytes


def streams(source: str) -> bool:
    """Does a generated elementwise or row kernel write its output with streaming stores?"""
    return "fp_stream(" in source or "fp_row_store(" in source


def bindable(arr: np.ndarray, storage: np.ndarray, transposed_ok: bool = False) -> bool:
    """Can the kernels read ``arr`` in place of ``storage``: same dtype and shape, aligned, C order (or, with
    ``transposed_ok``, the transpose of a C-ordered matrix: an nn.Linear weight read as (K, N))?"""
    order = arr.flags.c_contiguous or (transposed_ok and arr.ndim == 2 and arr.flags.f_contiguous)
    return arr.dtype == storage.dtype and arr.shape == storage.shape and order and arr.flags.aligned


def gemm_b_only(plan: Plan, dtypes: frozenset[str] = frozenset({"fp32"})) -> frozenset[str]:
    """Tensors of ``dtypes`` that only GEMM libraries read, as their right operand: the library takes them in
    either order, so a transposed weight is read in place (16-bit ones only where torch's native product
    reads them: widening for BLAS needs C order).  Those of them that are inputs are the weights the backend
    may store with padded rows (``gemm.weight_layout``; docs/backends.md)."""
    b_operands: set[str] = set()
    other: set[str] = set()  # read by a generated loop (an epilogue included) or as a left operand
    for k in plan.kernels:
        mm = find_matmul(k.body) if k.kind in (KernelKind.GEMM_EPILOGUE, KernelKind.CUBLASLT) else None
        if mm is None:
            other.update(k.reads)
            continue
        a, b = mm.args
        b_operands.update([b.tensor] if isinstance(b, Load) else [])
        other.update([a.tensor] if isinstance(a, Load) else [])
        other.update(x.tensor for e in k.body.walk() if e is not mm for x in e.args if isinstance(x, Load))
    return frozenset(n for n in b_operands - other - set(plan.outputs) if plan.tensors[n].dtype in dtypes)


def weights_fact(b_buf: np.ndarray) -> str:
    """A GEMM kernel's ``weights`` fact: "padded" where its right operand's buffer has padded rows."""
    return "padded" if b_buf.strides[0] != b_buf.shape[1] * b_buf.itemsize else "as stored"


#: the step implementations that call numpy's BLAS
_BLAS_IMPLS = ("numpy-gemm", "numpy-batched-gemm", "numpy-reference")


class CpuCompiledPlan(CompiledPlan):
    def __init__(
        self,
        plan: Plan,
        steps: list[Step],
        memory: Memory,
        inputs: list[str],
        compile_s: float,
        backend: CpuBackend,
        padded: frozenset[str] = frozenset(),
    ):
        super().__init__(plan, [dict(s.facts, bytes_moved=s.bytes_moved) for s in steps], compile_s)
        self.steps = steps
        self.memory = memory
        self.buffers = memory.own
        self.input_names = inputs
        #: weights stored with padded rows: a read-only array bound to one (a parameter) is read from the
        #: backend's padded copy of it, made once for every plan the backend compiles
        self.padded = padded
        self.held = backend.held
        self._transposed_ok = gemm_b_only(plan, frozenset({"fp32", *(d for d in ("bf16", "fp16") if backend.native(d))}))
        self.threads = backend.threads
        self.blas_threads = backend.blas_threads
        self.controller = backend.controller
        # torch's pool at the plan's thread count for the whole run (one switch, not one per kernel) where any
        # kernel calls torch: an Opaque one, or a product, attention or batched product of torch's
        self.uses_torch = any(s.kernel.kind == KernelKind.OPAQUE or str(s.facts.get("impl", "")).startswith(("torch", "onednn"))
                              for s in steps)
        # numpy's BLAS runs in numpy's GEMMs and batched products, in the reference's numpy form of a kernel and
        # in numpy Opaque implementations; generated loops and torch's products never call it, and threadpoolctl's
        # limit costs 15 µs a call, 70 with cold caches after a plan's kernels (it walks the loaded libraries)
        self.uses_blas = any(s.kernel.kind == KernelKind.OPAQUE or str(s.facts.get("impl", "")).startswith(_BLAS_IMPLS)
                             for s in steps)
        written = {k.out for k in plan.kernels}
        self._fresh_outputs = [o for o in dict.fromkeys(plan.outputs) if o in written and plan.tensors[o].dtype == "fp32"]
        self._fresh_stored = [o for o in dict.fromkeys(plan.outputs) if o in written]  # 16-bit ones too (run_stored)
        # 16-bit outputs are handed out widened to fp32 by a generated loop (ml_dtypes' conversion is ~10x slower)
        self._widen_out = {d: backend.compiler.function(widen_source(d), 2)
                           for d in {plan.tensors[o].dtype for o in plan.outputs} if d != "fp32"}
        #: per input, the array of the last call that needs nothing on the next: read in place, or read-only
        #: and already copied (a writable array that was copied may have changed, so it is copied again)
        self._kept: dict[str, Any] = {}
        self.loads = 0  # inputs copied into buffers so far (tests count them)
        self.packs = 0  # weights packed by oneDNN for this plan's calls (tests count them)
        self.binds = 0  # inputs the kernels read in place, without a copy
        self._handed_out: dict[str, np.ndarray] = {}  # the fp32 output array each output got last
        self.reused = 0  # output arrays reused because their caller had dropped them

    def _load_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        kept = self._kept
        for name in self.input_names:
            if name not in inputs:
                raise BackendError(f"missing input {name!r}")
            given = inputs[name]
            if kept.get(name) is given:  # the array of the last call, read in place or held unchanged: as it was
                self.binds += 1
                continue
            kept.pop(name, None)
            arr = self._load(name, given)
            if name in self.memory.packable:
                self._pack(name, arr)

    def _load(self, name: str, given: Any) -> np.ndarray:
        """Bind input ``name`` to ``given`` (read in place, or its held copy) or copy it into its buffer."""
        kept = self._kept
        ttype = self.plan.tensors[name]
        arr = np.asarray(given)
        if tuple(arr.shape) != tuple(ttype.shape):
            raise BackendError(f"input {name!r} has shape {list(arr.shape)}, expected {list(ttype.shape)}")
        own = self.memory.own[name]
        # a 16-bit array of the tensor's own dtype: its bits are the storage
        bits = arr.view(np.uint16) if own.dtype == np.uint16 and arr.dtype == numpy_dtype(ttype.dtype) else None
        stored = arr if bits is None else bits
        if name in self.padded and not arr.flags.writeable:  # a parameter: multiplied from its padded copy
            copy, made = self.held.padded(arr)
            self.memory.bind(name, copy)
            self.loads += made
            kept[name] = given
            return arr
        if bindable(stored, own, name in self._transposed_ok):  # read in place
            self.memory.bind(name, stored)
            self.binds += 1
            kept[name] = given
            return arr
        self.memory.restore(name)
        if bits is None:
            to_storage(arr, ttype.dtype, own)
        else:
            np.copyto(own, bits)
        self.loads += 1
        if not arr.flags.writeable:  # read-only (a bound parameter): its copy stays valid
            kept[name] = given
        return arr

    def _pack(self, name: str, arr: np.ndarray) -> None:
        """A read-only 16-bit weight (a bound parameter) is multiplied from oneDNN's packed form of it, made once
        for every plan of the backend; a writable one may change before the next call and is read as bound."""
        packed = self.memory.packed
        if arr.flags.writeable:
            packed.pop(name, None)
            return
        stored, dtype = self.memory.arrays[name], self.plan.tensors[name].dtype
        packed[name], made = self.held.form(arr, f"packed-{dtype}", lambda: gemm.pack_weight(stored, dtype))
        self.packs += made

    def _output_array(self, name: str) -> np.ndarray:
        """An array for output ``name`` no one else can see: the one handed out last time if the caller has
        dropped every reference to it (and to every view of it), else a new one.  Reusing it spares
        the page faults of fresh memory, as torch's caching allocator does."""
        spare = self._handed_out.get(name)
        # references: the dict, ``spare`` and getrefcount's argument; a torch tensor or view adds one
        if spare is not None and sys.getrefcount(spare) <= 3:
            self.reused += 1
            return spare
        arr = np.empty_like(self.memory.own[name])  # owns its memory, so a view of it holds a reference to it
        self._handed_out[name] = arr
        return arr

    def _widened(self, stored: np.ndarray, dtype: str) -> np.ndarray:
        """A fresh fp32 array of a stored output's values."""
        if stored.dtype == np.float32 or not stored.flags.c_contiguous:  # fp32 already, or a strided input
            return np.array(from_storage(stored, dtype))
        out = aligned_empty(stored.shape, np.float32)
        self._widen_out[dtype](stored.ctypes.data, out.ctypes.data, 0, *rows_cols(stored.shape))
        return out

    def _own_outputs(self) -> None:
        for name in self._fresh_stored:
            self.memory.restore(name)

    def _execute(self) -> None:
        for s in self.steps:
            s.call()

    def execute(self) -> None:
        """Run the kernels once on the inputs bound by the last ``run`` or ``time``, into the plan's own
        output buffers: the plan's bare kernel time, without binding inputs or handing outputs out."""
        self._own_outputs()
        with self._pools():
            self._execute()

    def _pools(self) -> contextlib.ExitStack:
        """BLAS at its pinned count and torch's pool at the plan's thread count while the plan runs."""
        stack = contextlib.ExitStack()
        if self.uses_blas:
            stack.enter_context(limit_blas_threads(self.blas_threads, self.controller))
        if self.uses_torch:
            stack.enter_context(parallel.torch_threads(self.threads))
        return stack

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Execute once.  fp32 outputs are fresh arrays the last kernel wrote (never shared with another
        call), 16-bit ones fresh fp32 arrays widened from them; inputs stored as the kernels read them are read
        in place, never written."""
        return self._run(inputs, self._fresh_outputs, widen=True)

    def run_stored(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Execute once; every output a fresh array the last kernel wrote as it is stored (fp32, or a 16-bit
        dtype's bits as ``uint16``): no widening pass, for a caller that hands out 16-bit tensors."""
        return self._run(inputs, self._fresh_stored, widen=False)

    def _run(self, inputs: Mapping[str, np.ndarray], fresh_names: list[str], widen: bool) -> list[np.ndarray]:
        self._load_inputs(inputs)
        fresh = {}
        for name in fresh_names:
            fresh[name] = self._output_array(name)
            self.memory.bind(name, fresh[name])
        try:
            with self._pools():
                self._execute()
        finally:
            self._own_outputs()  # the memory keeps no reference to what is handed out
        outs: list[np.ndarray] = []
        for o in self.plan.outputs:
            arr = fresh.pop(o, None)  # each fresh array handed out once; a repeated output gets a copy
            if arr is None:
                written = next((a for name, a in zip(self.plan.outputs, outs, strict=False) if name == o),
                               self.memory.arrays[o])
                arr = self._widened(written, self.plan.tensors[o].dtype) if widen else np.array(written)
            outs.append(arr)
        return outs

    def time(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        warmup: int = 2,
        repeats: int = 7,
        stop_if: Callable[[float], bool] | None = None,
    ) -> Timing:
        self._load_inputs(inputs)
        self._own_outputs()
        steps = self.steps
        fastest = [math.inf] * len(steps)  # ns, each step's fastest run in place (two clock reads a step)

        def measure_us() -> float:
            t0 = last = time.perf_counter_ns()
            for i, s in enumerate(steps):
                s.call()
                now = time.perf_counter_ns()
                fastest[i] = min(fastest[i], now - last)
                last = now
            return (last - t0) / 1e3

        with self._pools():
            timing = collect_samples(measure_us, warmup=warmup, repeats=repeats, stop_if=stop_if)
        timing.kernel_min_us = [ns / 1e3 for ns in fastest]
        return timing


class CpuBackend(Backend):
    name = "cpu"
    measures = True

    def __init__(
        self,
        spec: DeviceSpec,
        compiler: Compiler | None = None,
        tile_bytes: int | None = None,
        blas_threads: int | None | str = "env",
        threads: int | None = None,
        stream_bytes: int | None = None,
        gemm_library: str | None = None,
    ) -> None:
        """``threads``: worker threads a plan runs on (None: ``FUSION_PLANNER_THREADS``, else every
        available core; see :mod:`backends.cpu.parallel`).  ``blas_threads``: threads
        BLAS may use inside one GEMM block (None: the library's default; "env":
        ``FUSION_PLANNER_BLAS_THREADS``, else :data:`DEFAULT_BLAS_THREADS`).  ``gemm_library``: numpy,
        torch or auto (None: ``FUSION_PLANNER_CPU_GEMM``; :mod:`backends.cpu.gemm`)."""
        super().__init__(spec)
        self.gemm_library = gemm.library_from_env(gemm_library)
        self.matmul = gemm.matmul(self.gemm_library)
        self.bmm = standalone.batch_matmul(self.gemm_library)
        self.threads = parallel.check_threads(threads)
        self.pool = parallel.WorkerPool(self.threads)
        self.blas_threads: int | None = (
            blas_threads_from_env() if isinstance(blas_threads, str) else blas_threads
        )
        #: how fp32 weights held between calls are stored: "padded" rows or "given" (gemm.weight_layout)
        self.weights = gemm.weight_layout(self.gemm_library)
        self.held = HeldWeights()

        self.controller = ThreadpoolController()  # numpy's BLAS is loaded by now
        try:
            self.compiler = compiler or Compiler()
        except CompilerUnavailable as exc:
            raise BackendUnavailable(str(exc)) from None
        if self.threads > 1:  # the generated kernels' parts run on the process's pthreads
            self.pool.native = native_pool.shared_pool(self.compiler, self.threads)
        if tile_bytes is None:
            size, origin = cache_bytes()
            tile_bytes = size // 4
            log.info("GEMM tiles up to %d bytes (a quarter of %d, from %s)", tile_bytes, size, origin)
        self.tile_bytes = tile_bytes
        #: outputs of at least this many bytes are written with streaming stores (elementwise kernels)
        self.stream_bytes = stream_bytes if stream_bytes is not None else stream_bytes_default()
        self._types_of: tuple[Mapping[str, TensorType], dict[str, tuple[tuple[int, ...], str]]] | None = None

    # -- compile
    def compile(self, plan: Plan) -> CpuCompiledPlan:
        t0 = time.perf_counter()
        written = [k.out for k in plan.kernels]
        if len(set(written)) != len(written):
            raise BackendError("plan writes one tensor from two kernels")
        read = {r for k in plan.kernels for r in k.reads}
        inputs = sorted((read | set(plan.outputs)) - set(written))
        padded = gemm_b_only(plan) & set(inputs) if self.weights == "padded" else frozenset()
        packed_dtypes = self.packed_dtypes({plan.tensors[n].dtype for n in inputs if n in plan.tensors}
                                           & set(gemm.DTYPES_16BIT))
        packable = gemm_b_only(plan, packed_dtypes) & set(inputs) if packed_dtypes else frozenset()
        missing = [n for n in inputs + written if n not in plan.tensors]
        if missing:
            raise BackendError(f"plan has no type for tensor {missing[0]!r}")
        intermediates = set(written) - set(plan.outputs)
        views, handed = layout_views(plan, functools.partial(self._torch_attention, tensors=plan.tensors))
        # a Heads view is read where its source is: the source lives until the view's last reader
        reads = [[*k.reads, *loads(k.body)] for k in plan.kernels]
        shared = shared_buffers(
            [(k.out, [*r, *(views[t] for t in r if t in views)]) for k, r in zip(plan.kernels, reads, strict=True)],
            {n: math.prod(plan.tensors[n].shape) * storage_dtype(plan.tensors[n].dtype).itemsize for n in intermediates})
        buffers: dict[str, np.ndarray] = {}
        for name in inputs + written:
            ttype = plan.tensors[name]
            dtype = storage_dtype(ttype.dtype)
            if name in padded:  # a writable call input is copied in; a parameter is read from self.held
                k_rows, n_cols = ttype.shape  # a GEMM's right operand is 2-D
                buffers[name] = padded_matrix(k_rows, n_cols, np.float32, zero=True)
            elif name in shared:
                buffers[name] = typed_view(shared[name], ttype.shape, dtype)
            else:
                buffers[name] = aligned_empty(ttype.shape, dtype, zero=True)
        memory = Memory(buffers, frozenset(plan.outputs), packable, views, handed)
        steps = []
        for i, k in enumerate(plan.kernels):
            try:
                steps.append(self._step(k, plan.tensors, memory))
            except (CodegenError, BackendError) as exc:
                raise BackendError(f"kernel {i} ({k.describe()}): {exc}") from exc
        return CpuCompiledPlan(plan, steps, memory, inputs, time.perf_counter() - t0, self, padded)

    def prepare(self, plans: Sequence[Plan]) -> None:
        """Compile every kernel of ``plans`` that is not in the kernel cache, in one batched compiler run
        per worker thread, all at once (a search's candidates share most of their kernels)."""
        sources: dict[str, None] = {}
        for plan in plans:
            for k in plan.kernels:
                try:
                    sources.update(dict.fromkeys(self._sources(k, plan.tensors)))
                except (CodegenError, BackendError, KeyError):
                    continue  # compile() reports it, for the candidate it belongs to
        try:
            built = self.compiler.build_many(list(sources), jobs=self.threads)
        except CodegenError as exc:  # a hanging or missing compiler: each candidate reports it when compiled
            log.warning("batched kernel build failed (%s); kernels are built one by one", exc)
            return
        log.info("prepared %d kernels of %d plans: %d compiled, the rest cached", len(sources), len(plans), built)

    def _sources(self, k: Kernel, tensors: Mapping[str, TensorType]) -> list[str]:
        """The generated sources ``compile`` will load for kernel ``k`` (as :meth:`_step` generates them)."""
        types = self._types(tensors)
        if k.kind == KernelKind.ELEMENTWISE:
            return [generate(k.body, types, stream=self._streams(tensors[k.out])).source]
        if k.kind in (KernelKind.GEMM_EPILOGUE, KernelKind.CUBLASLT):
            mm = find_matmul(k.body)
            tile_dtype = self._tile_dtype(k, tensors)
            widen = [widen_source(tensors[a.tensor].dtype) for a in mm.args  # type: ignore[union-attr]
                     if DTYPES[tensors[a.tensor].dtype].bytes != 4 and tile_dtype == "fp32"]  # type: ignore[union-attr]
            return [generate(k.body, types, tile=mm, tile_dtype=tile_dtype).source, *widen]
        if k.kind == KernelKind.STANDALONE:
            source = standalone.source_of(k.body, {n: t[0] for n, t in types.items()})
            dtype = k.body.type.dtype
            if source is None or dtype == "fp32":
                return [] if source is None else [source]
            if self.native(dtype):
                return []  # torch's fused attention
            return [source, widen_source(dtype), narrow_source(dtype)]
        return []

    def _streams(self, out: TensorType) -> bool:
        """Is an elementwise output this large written with streaming stores?"""
        return math.prod(out.shape) * storage_dtype(out.dtype).itemsize >= self.stream_bytes

    @property
    def identity(self) -> str:
        """What the plan cache keys on besides the device: a choice timed on 1 thread may not be best on 8."""
        packed = ",".join(sorted(d for d in gemm.DTYPES_16BIT if self._packs(d))) or "none"
        return f"cpu threads={self.threads} gemm={self.gemm_library} weights={self.weights} packed={packed}"

    def _packs(self, dtype: str) -> bool:
        """Whether weights of ``dtype`` are packed, for the identity: a dtype this CPU cannot pack, where the
        environment asks for packing, counts as not packed here (a plan of that dtype is refused at compile)."""
        try:
            return bool(self.packed_dtypes((dtype,)))
        except BackendError:
            return False

    def packed_dtypes(self, dtypes: Iterable[str] = gemm.DTYPES_16BIT) -> frozenset[str]:
        """Those of the 16-bit ``dtypes`` whose weights this backend multiplies from oneDNN's packed form
        (``gemm.weight_layout_16bit``): those torch multiplies natively here, where packing is chosen."""
        return frozenset(d for d in dtypes if self.native(d) and gemm.weight_layout_16bit(d) == "packed")

    def _step(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        # generated loops trust these shapes: a mismatch would write out of bounds
        out_t = tensors[k.out]
        if tuple(out_t.shape) != tuple(k.body.type.shape) or out_t.dtype != k.body.type.dtype:
            raise BackendError(
                f"body computes {list(k.body.type.shape)} {k.body.type.dtype} but tensor {k.out!r} "
                f"is {list(out_t.shape)} {out_t.dtype}"
            )
        if k.kind == KernelKind.ELEMENTWISE:
            return self._elementwise(k, tensors, memory)
        if k.kind in (KernelKind.GEMM_EPILOGUE, KernelKind.CUBLASLT):
            return self._gemm(k, tensors, memory)
        if k.kind == KernelKind.OPAQUE:
            return self._opaque(k, tensors, memory)
        if k.kind == KernelKind.STANDALONE:
            return self._standalone(k, tensors, memory)
        raise BackendError(f"unknown kernel kind {k.kind!r}")

    def _types(self, tensors: Mapping[str, TensorType]) -> dict[str, tuple[tuple[int, ...], str]]:
        """Shape and dtype by tensor, for codegen; one plan's kernels share its table (built once per plan:
        a 1,000-op plan's kernels built it 1,000 times)."""
        if self._types_of is None or self._types_of[0] is not tensors:
            self._types_of = (tensors, {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()})
        return self._types_of[1]

    def _bind(self, ck: CKernel, buffers: Mapping[str, np.ndarray]) -> tuple[Callable[..., None], list[str | None], list[np.ndarray]]:
        """The compiled function, the tensor of each pointer parameter (None: the GEMM tile), the buffers read."""
        fn = self.compiler.function(ck.source, len(ck.params) + 1)
        names, reads = [], []
        for p in ck.params:
            if p.tensor is not None and p.tensor not in buffers:
                raise BackendError(f"kernel loads {p.tensor!r}, which is neither an input nor written by a kernel")
            names.append(p.tensor)
            if p.tensor is not None:
                reads.append(buffers[p.tensor])
        return fn, names, reads

    def _elementwise(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        ck = generate(k.body, self._types(tensors), stream=self._streams(tensors[k.out]))
        fn, params, reads = self._bind(ck, memory.own)
        names = [n for n in params if n is not None]
        out_name, addr, pool, rows, cols = k.out, memory.addr, self.pool, ck.rows, ck.cols
        flat = not ck.row_width and all(p.index == "full" for p in ck.params)  # a row kernel runs whole rows
        parts = parallel.loop_parts(self.threads, rows * max(cols, ck.row_width))
        threads = 1
        if parts == 1:
            if flat:  # one row of every element: the form a streaming kernel streams
                rows, cols = 1, rows * cols

            def call() -> None:
                fn(*[addr[n] for n in names], addr[out_name], 0, rows, cols)
        elif flat:  # every operand in the output's layout: any shape splits
            sizes = [storage_dtype(p.dtype).itemsize for p in ck.params]
            out_size = memory.own[k.out].itemsize
            ranges = parallel.split(rows * cols, parts, parallel.CHUNK_ALIGN)
            threads = len(ranges)

            def call() -> None:
                ptrs = [addr[n] for n in names]
                out = addr[out_name]
                pool.run_kernel(fn, len(ptrs) + 1, [[*(p + e0 * z for p, z in zip(ptrs, sizes, strict=True)),
                                                     out + e0 * out_size, 0, 1, e1 - e0] for e0, e1 in ranges])
        else:  # a row vector read by column: split the rows
            row_ranges = parallel.split(rows, parts)
            threads = len(row_ranges)

            def call() -> None:
                ptrs = [addr[n] for n in names]
                out = addr[out_name]
                pool.run_kernel(fn, len(ptrs) + 1, [[*ptrs, out, r0, r1, cols] for r0, r1 in row_ranges])

        return Step(k, call, reads, memory.own[k.out], {"impl": "c-loop", "threads": threads,
                                                        "streaming_stores": streams(ck.source),
                                                        "source_sha256": ck.digest[:16]})

    def _widen(self, memory: Memory, name: str, dtype: str, max_rows: int) -> tuple[Callable[[int, int], np.ndarray], int]:
        """``widen(r0, r1)``: fp32 values of rows r0..r1 of a GEMM operand, and the scratch bytes used.

        fp32 operands are views of their array; 16-bit ones are converted into a scratch of
        ``max_rows`` rows by a generated kernel (numpy's fp16 conversion is about 10x slower),
        the analogue of BLAS packing.
        """
        buf = memory.own[name]
        arrays, addr = memory.arrays, memory.addr
        if buf.dtype == np.float32:
            return (lambda r0, r1: arrays[name][r0:r1]), 0
        cols = buf.shape[-1]
        wide = aligned_empty((max_rows, cols), np.float32)
        fn = self.compiler.function(widen_source(dtype), 2)
        dst, row_bytes = wide.ctypes.data, cols * buf.itemsize

        def widen(r0: int, r1: int) -> np.ndarray:
            fn(addr[name] + r0 * row_bytes, dst, 0, r1 - r0, cols)
            return wide[: r1 - r0]

        return widen, wide.nbytes

    def native(self, dtype: str) -> bool:
        """Does this backend multiply ``dtype`` (16-bit) in torch's native kernels rather than widening it?  Its
        own choice (``FUSION_PLANNER_CPU_GEMM_16BIT``), whichever library multiplies fp32, where torch is loaded."""
        return dtype != "fp32" and (self.gemm_library == "torch" or "torch" in sys.modules) and gemm.native_16bit(dtype)

    def _tile_dtype(self, k: Kernel, tensors: Mapping[str, TensorType]) -> str:
        """How a GEMM kernel's product tile is stored: in the operands' 16-bit dtype where torch multiplies it
        natively (the product rounded to it, as eager torch rounds a Linear's output), else fp32."""
        mm = find_matmul(k.body)
        dtypes = {tensors[a.tensor].dtype for a in mm.args if isinstance(a, Load)}
        (dtype,) = dtypes if len(dtypes) == 1 else ("fp32",)
        return dtype if self.native(dtype) else "fp32"

    @staticmethod
    def _stored(memory: Memory, name: str) -> tuple[Callable[[int, int], np.ndarray], int]:
        """``rows(r0, r1)``: rows r0..r1 of a GEMM operand as stored (no scratch)."""
        arrays = memory.arrays
        return (lambda r0, r1: arrays[name][r0:r1]), 0

    def _gemm(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        step = self._library_gemm(k, tensors, memory)
        post = self._post_ops(k, tensors, memory)
        return step if post is None else self._with_post_ops(k, memory, step, *post)

    def _post_ops(self, k: Kernel, tensors: Mapping[str, TensorType],
                  memory: Memory) -> tuple[str, str, str | None, gemm.PackedLinear] | None:
        """(a, b, bias, linear) where a cublaslt kernel's epilogue is one oneDNN applies to the packed product
        itself (``gemm.ONEDNN_POST_OPS``): its right operand a packable weight, every operand and the output of
        the dtype torch multiplies natively; else None."""
        if k.kind != KernelKind.CUBLASLT or k.epilogue not in gemm.ONEDNN_POST_OPS:
            return None
        mm = find_matmul(k.body)
        a_name, b_name = (a.tensor for a in mm.args)  # type: ignore[union-attr]
        bias = next((r for r in k.reads if r not in (a_name, b_name)), None) if epilogue_has_bias(k.epilogue) else None
        dtype = self._tile_dtype(k, tensors)
        operands = [a_name, b_name, k.out, *([bias] if bias else [])]
        if dtype == "fp32" or b_name not in memory.packable or any(tensors[n].dtype != dtype for n in operands):
            return None
        return a_name, b_name, bias, gemm.packed_linear(dtype, *gemm.ONEDNN_POST_OPS[k.epilogue])

    @staticmethod
    def _with_post_ops(k: Kernel, memory: Memory, step: Step, a_name: str, b_name: str, bias: str | None,
                       linear: gemm.PackedLinear) -> Step:
        """A cublaslt kernel as oneDNN's packed product with its epilogue as post-ops, while the weight is packed
        (``step``, the product and generated epilogue, otherwise).  The result is handed to the readers as oneDNN
        wrote it (a fresh contiguous tensor), copied only into a plan output."""
        arrays, packed, out_name, regular = memory.arrays, memory.packed, k.out, step.call
        is_output, shape = out_name in memory.outputs, memory.own[k.out].shape

        def call() -> None:
            weight = packed.get(b_name)
            if weight is None:
                if not is_output:
                    memory.restore(out_name)
                regular()
                return
            result = gemm.tensor_bits(linear(arrays[a_name], weight, None if bias is None else arrays[bias]))
            if is_output:
                np.copyto(arrays[out_name], result.reshape(shape))
            else:
                memory.bind(out_name, result.reshape(shape))

        facts = dict(step.facts, impl=f"onednn-{k.body.type.dtype}-post-ops", weights="packed if read-only")
        return Step(k, call, step.reads, step.writes, facts)

    def _library_gemm(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        mm = find_matmul(k.body)
        a_name, b_name = (a.tensor for a in mm.args)  # type: ignore[union-attr]
        buffers = memory.own
        for name in (a_name, b_name):
            if name not in buffers:
                raise BackendError(f"GEMM reads {name!r}, which is neither an input nor written by a kernel")
        a_buf, b_buf = buffers[a_name], buffers[b_name]
        rows, cols = rows_cols(tuple(k.body.type.shape))
        kdim = a_buf.shape[-1]
        if a_buf.shape != (rows, kdim) or b_buf.shape != (kdim, cols):
            raise BackendError(f"GEMM operands {list(a_buf.shape)} @ {list(b_buf.shape)} do not give {[rows, cols]}")
        # numpy's BLAS: one row block per worker, BLAS on one thread inside each.  torch: one block, torch.mm
        # on every thread (MKL's own split of a GEMM beat ours by 1.2-1.3x on 2 cores here), and each
        # tile's epilogue split by rows across the workers.
        torch_gemm = self.gemm_library == "torch"
        blocks = [(0, rows)] if torch_gemm else parallel.split(rows, parallel.gemm_parts(self.threads, rows))
        # the workers share the last-level cache: each block's tiles get its share of the tile budget
        tile_rows = min(gemm_tile_rows(rows, cols, kdim, self.tile_bytes // len(blocks)), blocks[0][1] - blocks[0][0])
        a_dtype, b_dtype = tensors[a_name].dtype, tensors[b_name].dtype
        # torch multiplies some 16-bit dtypes natively (AMX): the operands are read as stored, never widened,
        # and the epilogue reads the product's 16-bit tile
        tile_dtype = self._tile_dtype(k, tensors)
        native = tile_dtype != "fp32"
        stored = native or a_dtype == b_dtype == "fp32"  # the library reads both operands as stored
        # a torch product keeps its operands' views while they stay the same arrays (not one handed out)
        keep = (a_name not in memory.outputs, b_name not in memory.outputs)
        linear = gemm.packed_linear(tile_dtype) if native and b_name in memory.packable else None
        if k.body is mm and stored and k.body.type.dtype == tile_dtype:
            product = gemm.torch_mm(tile_dtype, (*keep, False)) if native or torch_gemm else self.matmul
            step = self._product(k, memory, a_name, b_name, self._packing(memory, b_name, product, linear))
            step.facts["weights"] = "packed if read-only" if linear else step.facts["weights"]
            return step
        widen_b, b_scratch = self._stored(memory, b_name) if native else self._widen(memory, b_name, b_dtype, b_buf.shape[0])
        ck = generate(k.body, self._types(tensors), tile=mm, tile_dtype=tile_dtype)
        b_rows = b_buf.shape[0]
        scratch = b_scratch
        blockwork: list[tuple[Callable[..., None], list[str | None], np.ndarray, Callable[[int, int], np.ndarray],
                              list[tuple[int, int]]]] = []
        reads: list[np.ndarray] = []
        for slot, (r_start, r_end) in enumerate(blocks):
            tile = memory.scratch(slot, (tile_rows, cols), storage_dtype(tile_dtype))
            widen_a, a_scratch = self._stored(memory, a_name) if native else self._widen(memory, a_name, a_dtype,
                                                                                          tile_rows)
            fn, params, reads = self._bind(ck, buffers)
            scratch += tile.nbytes + a_scratch
            bounds = [(r, min(r_end, r + tile_rows)) for r in range(r_start, r_end, tile_rows)]
            blockwork.append((fn, params, tile, widen_a, bounds))
        pool, addr, out_name, threads = self.pool, memory.addr, k.out, self.threads
        facts = {
            "impl": f"torch-{a_dtype}-gemm+c-epilogue" if native else f"{self.gemm_library}-gemm+c-epilogue",
            "tile_rows": tile_rows,
            "tiles": sum(-(-(end - start) // tile_rows) for start, end in blocks),
            "threads": threads if torch_gemm else len(blocks),
            "scratch_bytes": scratch,
            "blas_threads": self.blas_threads or "default",
            "weights": "packed if read-only" if linear else weights_fact(b_buf),
            "source_sha256": ck.digest[:16],
        }
        step_reads = [a_buf, b_buf] + [b for b in reads if b is not a_buf and b is not b_buf]
        if torch_gemm and stored and tile_rows >= rows:  # one tile, operands as stored: the short route
            (fn, params, tile, _, _), = blockwork
            call_one = self._one_tile(memory, (a_name, b_name, out_name), gemm.torch_mm(tile_dtype, (*keep, True)),
                                      fn, params, tile, linear)
            return Step(k, call_one, step_reads, buffers[k.out], facts)
        product = self._packing(memory, b_name, gemm.torch_mm(a_dtype) if native else self.matmul, linear)

        def call() -> None:
            b32 = widen_b(0, b_rows)  # B as the product reads it (fp32: widened once), shared by the blocks
            out = addr[out_name]
            if torch_gemm:
                ((fn, params, tile, widen_a, bounds),) = blockwork
                epilogue = _split_epilogue(pool, threads, fn, [None if n is None else addr[n] for n in params],
                                           tile.ctypes.data, out, cols, tile.itemsize)
                _gemm_block(product, epilogue, tile, widen_a, b32, bounds)  # torch's threads: the plan's (_pools)
                return
            pool.run([functools.partial(_gemm_block, product, functools.partial(
                          fn, *[tile.ctypes.data if n is None else addr[n] for n in params], out), tile, widen_a, b32, bounds)
                      for fn, params, tile, widen_a, bounds in blockwork])

        return Step(k, call, step_reads, buffers[k.out], facts)

    def _one_tile(self, memory: Memory, names: tuple[str, str, str], product: gemm.MatMul, fn: Callable[..., None],
                  params: list[str | None], tile: np.ndarray, linear: gemm.PackedLinear | None) -> Callable[[], None]:
        """A torch GEMM + epilogue whose product is one tile, operands read as stored: the product of the
        operands as bound (or by ``linear`` from the right operand's packed form, when it has one: the epilogue
        reads oneDNN's result in place of the tile), then the epilogue over every row (on the calling thread, or
        split across the pool)."""
        a_name, b_name, out_name = names
        arrays, addr, pool, threads, packed = memory.arrays, memory.addr, self.pool, self.threads, memory.packed
        rows, cols = tile.shape
        tile_ptr, itemsize = tile.ctypes.data, tile.itemsize

        def call() -> None:
            weight = packed.get(b_name) if linear is not None else None
            if weight is None:
                product(arrays[a_name], arrays[b_name], tile)  # on the plan's torch threads (CpuCompiledPlan._pools)
                ptr = tile_ptr
            else:
                result = linear(arrays[a_name], weight)  # type: ignore[misc]  # alive until the epilogue is done
                ptr = result.data_ptr()
            if threads == 1:
                fn(*[ptr if n is None else addr[n] for n in params], addr[out_name], 0, rows, cols)
                return
            _split_epilogue(pool, threads, fn, [None if n is None else addr[n] for n in params], ptr,
                            addr[out_name], cols, itemsize)(0, rows, cols)

        return call

    @staticmethod
    def _packing(memory: Memory, b_name: str, product: gemm.MatMul, linear: gemm.PackedLinear | None) -> gemm.MatMul:
        """``product``, or, while the right operand has a packed form, ``linear``'s result copied into the output."""
        if linear is None:
            return product
        return gemm.packing(product, linear, functools.partial(memory.packed.get, b_name))

    def _product(self, k: Kernel, memory: Memory, a_name: str, b_name: str, product: gemm.MatMul) -> Step:
        """A GEMM kernel that is its product alone: the library writes the output's rows, no tile, no epilogue
        (which would only copy the tile).  Row blocks as in :meth:`_gemm`."""
        arrays, out_name, threads, pool = memory.arrays, k.out, self.threads, self.pool
        a_buf, b_buf = memory.own[a_name], memory.own[b_name]
        rows = a_buf.shape[0]
        torch_gemm = self.gemm_library == "torch"
        blocks = [(0, rows)] if torch_gemm else parallel.split(rows, parallel.gemm_parts(threads, rows))

        def call() -> None:
            a, b, out = arrays[a_name], arrays[b_name], arrays[out_name]
            if torch_gemm:  # on the plan's torch threads (CpuCompiledPlan._pools)
                product(a, b, out)
                return
            pool.run([functools.partial(product, a[r0:r1], b, out[r0:r1]) for r0, r1 in blocks])

        facts = {"impl": f"{self.gemm_library}-gemm", "threads": threads if torch_gemm else len(blocks),
                 "blas_threads": self.blas_threads or "default",
                 "weights": weights_fact(b_buf)}
        if k.body.type.dtype != "fp32":  # a 16-bit product torch multiplies natively
            facts["impl"] = f"torch-{k.body.type.dtype}-gemm"
        return Step(k, call, [a_buf, b_buf], memory.own[out_name], facts)

    def _standalone(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        body = k.body
        order = [a.tensor for a in body.args if isinstance(a, Load)]
        if len(order) != len(body.args):
            return self._converted(k, tensors, memory)
        arrays, out_name, reads = memory.arrays, k.out, [memory.own[n] for n in dict.fromkeys(order)]
        if body.op == "Heads" and out_name in memory.views:
            return self._heads_view(k, memory, order[0], reads)
        if body.op == "Merge" and order[0] in memory.handed:
            return self._merge_handed(k, memory, order[0], reads)
        if body.op in ("Heads", "Merge", "GroupRepeat"):  # a copy of the stored bits: any dtype
            copy = standalone.layout_copy(body)

            def call_copy() -> None:
                copy(arrays[order[0]], arrays[out_name])

            return Step(k, call_copy, reads, memory.own[k.out], {"impl": "numpy-layout-copy"})
        dtype = body.type.dtype
        if any(tensors[n].dtype != dtype for n in order):
            return self._converted(k, tensors, memory)
        if body.op in standalone.ATTENTION_OPS:
            return self._attention(k, tensors, memory, order, reads)
        bmm, impl = self.bmm, f"{self.gemm_library}-batched-gemm"
        if dtype != "fp32":
            if not self.native(dtype):
                return self._converted(k, tensors, memory)  # 16-bit storage: the reference's numpy form
            bmm, impl = standalone.torch_bmm_16bit(dtype), f"torch-{dtype}-batched-gemm"
        write = standalone.scores_writer(body, bmm, dtype) if body.op == "BatchScores" else bmm

        def call_product() -> None:  # a torch product runs on the plan's torch threads (CpuCompiledPlan._pools)
            write(arrays[order[0]], arrays[order[1]], arrays[out_name])

        return Step(k, call_product, reads, memory.own[k.out], {"impl": impl})

    def _attention(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory, order: list[str],
                   reads: list[np.ndarray]) -> Step:
        """The generated attention kernel, groups split across the pool.  16-bit q, k, v: torch's fused
        attention where torch multiplies the dtype natively (AMX: 0.22 ms against the generated kernel's 0.70
        for GPT-2's 12 heads of 128 tokens, bf16, one core here), else fp32 copies for the generated kernel
        and the result narrowed into its buffer (each a pass over a [groups, seq, head] tensor)."""
        body, out_name, addr = k.body, k.out, memory.addr
        groups, dtype = int(body.type.shape[0]), body.type.dtype
        facts = {"impl": "c-attention", "threads": min(self.threads, groups), "key_block": standalone.KEY_BLOCK}
        if self.native(dtype):
            attend, arrays, threads = standalone.torch_attention_16bit(body, dtype), memory.arrays, self.threads
            handed = out_name in memory.handed

            def call_torch() -> None:  # on the plan's torch threads (CpuCompiledPlan._pools)
                result = attend(*(arrays[n] for n in order))
                if handed:  # read by Merge steps only: as torch wrote it
                    memory.bind(out_name, gemm.tensor_bits(result))
                    return
                out = arrays[out_name]
                np.copyto(out.reshape(result.shape), gemm.tensor_bits(result))

            return Step(k, call_torch, reads, memory.own[out_name], {"impl": f"torch-sdpa-{dtype}", "threads": threads,
                                                                    "result": "handed" if handed else "copied"})
        source = standalone.source_of(body, {n: tuple(t.shape) for n, t in tensors.items()})
        assert source is not None
        fn = self.compiler.function(source, len(order) + 1)
        if dtype == "fp32":
            call = standalone.attention_call(fn, self.pool, self.threads, groups,
                                             lambda: [addr[n] for n in order] + [addr[out_name]])
            return Step(k, call, reads, memory.own[out_name], facts)
        wide = {n: aligned_empty(memory.own[n].shape, np.float32) for n in dict.fromkeys(order)}
        result = aligned_empty(memory.own[out_name].shape, np.float32)
        widen = self.compiler.function(widen_source(dtype), 2)
        narrow = self.compiler.function(narrow_source(dtype), 2)
        run_kernel = standalone.attention_call(fn, self.pool, self.threads, groups,
                                               lambda: [wide[n].ctypes.data for n in order] + [result.ctypes.data])

        def call_widened() -> None:
            for n, w in wide.items():
                widen(addr[n], w.ctypes.data, 0, *rows_cols(w.shape))
            run_kernel()
            narrow(result.ctypes.data, addr[out_name], 0, *rows_cols(result.shape))

        scratch = result.nbytes + sum(w.nbytes for w in wide.values())
        return Step(k, call_widened, reads, memory.own[out_name], dict(facts, impl=f"c-attention-{dtype}-widened",
                                                                 scratch_bytes=scratch))

    def _torch_attention(self, k: Kernel, tensors: Mapping[str, TensorType]) -> bool:
        """Is kernel ``k`` an attention that torch's fused kernel computes (16-bit, natively multiplied)?"""
        body = k.body
        return (k.kind == KernelKind.STANDALONE and body.op in standalone.ATTENTION_OPS
                and all(isinstance(a, Load) and tensors[a.tensor].dtype == body.type.dtype for a in body.args)
                and self.native(body.type.dtype))

    @staticmethod
    def _heads_view(k: Kernel, memory: Memory, source: str, reads: list[np.ndarray]) -> Step:
        """A Heads kernel only torch's attention reads: its result bound as a strided view of its source."""
        view, arrays, out_name = standalone.heads_view(k.body), memory.arrays, k.out
        last: list[np.ndarray] = []  # the source array and its view, kept while the source is the same array

        def call_view() -> None:
            x = arrays[source]
            if not last or last[0] is not x:
                last[:] = [x, view(x)]
            memory.bind(out_name, last[1])

        return Step(k, call_view, reads, memory.own[out_name], {"impl": "strided-view"})

    @staticmethod
    def _merge_handed(k: Kernel, memory: Memory, source: str, reads: list[np.ndarray]) -> Step:
        """A Merge of torch's attention result (batch, heads, seq, e): where torch wrote it in (batch, seq, heads,
        e) order (given strided operands) and it is not a plan output, its token rows are a view of it; else
        copied into the output."""
        arrays, out_name, shape = memory.arrays, k.out, memory.own[k.out].shape
        is_output = out_name in memory.outputs

        def call_merge() -> None:
            rows = standalone.merged_rows(arrays[source])
            if not is_output and rows.flags.c_contiguous:
                memory.bind(out_name, rows.reshape(shape))
                return
            if not is_output:
                memory.restore(out_name)
            np.copyto(arrays[out_name].reshape(rows.shape), rows)

        return Step(k, call_merge, reads, memory.own[out_name], {"impl": "view-or-copy"})

    def _opaque(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        own, arrays = memory.own, memory.arrays
        out_name = k.out
        reads = [own[n] for n in dict.fromkeys(k.reads)]
        direct = _direct_opaque(k, tensors)
        if direct is not None:  # fp32 in and out: the implementation reads the bound arrays and writes out
            write, order = direct

            def call() -> None:
                write([arrays[n] for n in order], arrays[out_name])

            return Step(k, call, reads, own[k.out], {"impl": "opaque-in-place"})
        return self._converted(k, tensors, memory)

    def _converted(self, k: Kernel, tensors: Mapping[str, TensorType], memory: Memory) -> Step:
        """A kernel computed by the reference's numpy form: its loads widened from storage, the result stored."""
        names = list(dict.fromkeys(k.reads))
        own, arrays = memory.own, memory.arrays
        out_name, dtype = k.out, k.body.type.dtype
        reads = [own[n] for n in names]

        def call_converted() -> None:
            mem = {n: from_storage(arrays[n], tensors[n].dtype) for n in names}
            value = eval_expr(k.body, mem, np.float32, {})
            out = arrays[out_name]
            if value.shape != out.shape:
                raise BackendError(f"{k.describe()} computed shape {list(value.shape)}, expected {list(out.shape)}")
            to_storage(value, dtype, out)

        return Step(k, call_converted, reads, own[k.out], {"impl": "numpy-reference"})


def layout_views(plan: Plan, torch_attention: Callable[[Kernel], bool]) -> tuple[dict[str, str], frozenset[str]]:
    """Layout kernels of ``plan`` that need copy nothing, around an attention torch computes
    (``torch_attention(kernel)``), which reads strided operands: (Heads result -> its source tensor) for Heads
    read only by such attentions, and the attentions read only by Merge kernels (their result handed over as
    torch wrote it).  Neither for a plan output, nor for a Heads of a plan output (a view would keep the
    caller's array alive)."""
    readers: dict[str, list[Kernel]] = {}
    for k in plan.kernels:
        for t in dict.fromkeys([*k.reads, *loads(k.body)]):
            readers.setdefault(t, []).append(k)
    outputs = set(plan.outputs)
    views: dict[str, str] = {}
    handed: set[str] = set()
    for k in plan.kernels:
        body, users = k.body, readers.get(k.out, [])
        if k.out in outputs or not users:
            continue
        if (k.kind == KernelKind.STANDALONE and body.op == "Heads" and isinstance(body.args[0], Load)
                and body.args[0].tensor not in outputs and all(torch_attention(u) for u in users)):
            views[k.out] = body.args[0].tensor
        elif torch_attention(k) and all(u.kind == KernelKind.STANDALONE and u.body.op == "Merge"
                                        and isinstance(u.body.args[0], Load) for u in users):
            handed.add(k.out)
    return views, frozenset(handed)


def _direct_opaque(k: Kernel, tensors: Mapping[str, TensorType]) -> tuple[Callable[..., None], list[str]] | None:
    """(writer, loaded tensors in argument order) for a kernel that is one Opaque node over loads with every
    tensor in fp32, whose implementation can write into a buffer; else None (the converting route)."""
    body = k.body
    if body.op != "Opaque" or not all(isinstance(a, Load) for a in body.args):
        return None
    order = [a.tensor for a in body.args]  # type: ignore[union-attr]
    if body.type.dtype != "fp32" or any(tensors[n].dtype != "fp32" for n in order):
        return None
    return opaque_writer(body.attr_dict), order


def _gemm_block(mm: gemm.MatMul, epilogue: Callable[[int, int, int], None], tile: np.ndarray,
                widen_a: Callable[[int, int], np.ndarray], b32: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """One block of a GEMM's rows: the GEMM library computes each tile of rows, the generated epilogue
    (``epilogue(r0, r1, cols)``) stores it."""
    cols = tile.shape[1]
    for r0, r1 in bounds:
        mm(widen_a(r0, r1), b32, tile[: r1 - r0])
        epilogue(r0, r1, cols)


def _split_epilogue(pool: parallel.WorkerPool, threads: int, fn: Callable[..., None], ptrs: list[int | None],
                    tile_ptr: int, out: int, cols: int, itemsize: int) -> Callable[[int, int, int], None]:
    """A tile's epilogue with its rows split across the pool (the tile pointer offset to each part's rows)."""
    row_bytes = cols * itemsize

    def run(r0: int, r1: int, cols: int) -> None:
        parts = parallel.split(r1 - r0, parallel.loop_parts(threads, (r1 - r0) * cols))
        pool.run_kernel(fn, len(ptrs) + 1, [[*[tile_ptr + s * row_bytes if p is None else p for p in ptrs],
                                             out, r0 + s, r0 + e, cols] for s, e in parts])

    return run

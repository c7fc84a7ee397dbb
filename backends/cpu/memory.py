"""The CPU backend's memory: buffers in their stored dtype, the cache sizes that shape GEMM tiles and streaming
stores, the steps a compiled plan runs, and BLAS's thread count while it runs."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from backends.codegen import find_matmul
from backends.cpu import parallel
from backends.cpu.buffers import (
    aligned_empty,
    typed_view,
)
from backends.cpu.standalone import GroupLayout
from planner.core.dtypes import DTYPES, numpy_dtype
from planner.core.kinds import KernelKind
from planner.core.plans import Expr, Kernel, Load, Plan

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


#: where Linux describes cpu0's caches
SYSFS_CACHE = "/sys/devices/system/cpu/cpu0/cache"


def cache_levels(base: str = SYSFS_CACHE) -> dict[int, int]:
    """Bytes of each data (or unified) cache level of cpu0 that sysfs reports, by level; empty if none."""
    levels: dict[int, int] = {}
    try:
        for entry in sorted(e for e in os.listdir(base) if e.startswith("index")):
            with open(f"{base}/{entry}/type") as f:
                kind = f.read().strip()
            with open(f"{base}/{entry}/level") as f:
                level = int(f.read().strip())
            with open(f"{base}/{entry}/size") as f:
                size = f.read().strip()
            if kind in ("Unified", "Data"):
                mult = {"K": 1024, "M": 1 << 20}.get(size[-1], 1)
                levels[level] = max(levels.get(level, 0), int(size.rstrip("KM")) * mult)
    except (OSError, ValueError):
        return {}
    return levels


def cache_bytes() -> tuple[int, str]:
    """Size of the last-level data cache (bytes) and where the figure came from.

    Read from sysfs (the largest Data/Unified level of cpu0), else ``os.sysconf``
    (L3, then L2), else :data:`DEFAULT_CACHE_BYTES`.  The last level, not L2:
    BLAS repacks the B operand on every call, so tiles of a few dozen rows (what
    a quarter of a 1 MiB L2 allows at N=K=1024) cost more GEMM throughput than
    fusion saves; a quarter of L3 still keeps the tile out of DRAM.
    """
    levels = cache_levels()
    if levels:
        return max(levels.values()), "sysfs"
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            v = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if v and v > 0:
            return int(v), f"sysconf {name}"
    return DEFAULT_CACHE_BYTES, "default"


def stream_bytes_default() -> int | None:
    """``FUSION_PLANNER_STREAM_BYTES``: a fixed threshold for streaming stores; None (unset): where they pay is
    measured on this machine (``backends.cpu.stream_probe``)."""
    return parallel.count_from_env("FUSION_PLANNER_STREAM_BYTES")


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
                 handed: frozenset[str] = frozenset(), convolved: Mapping[str, Expr] | None = None,
                 layouts: Mapping[str, GroupLayout] | None = None) -> None:
        self.own = own
        self.arrays = dict(own)
        self.addr = {n: a.ctypes.data for n, a in own.items()}
        self._own_addr = dict(self.addr)
        self.outputs = outputs  # tensors handed out to the caller (a fresh array each call)
        #: 16-bit weights a GEMM may multiply from oneDNN's packed form: those bound read-only have it in ``packed``
        self.packable = packable
        self.packed: dict[str, Any] = {}
        #: layout steps that copy nothing (``layout_views``), by their result: the tensor whose memory they read
        #: (Heads and GroupRepeat results read in place of their source, Merges of results written merged), and
        #: torch attention results handed to their Merge readers as torch wrote them
        self.views: Mapping[str, str] = views or {}
        self.handed = handed
        #: where a generated attention kernel reads an operand or writes its result other than as contiguous
        #: groups: a view's layout over its source, a result's over its Merge's rows
        self.layouts: Mapping[str, GroupLayout] = layouts or {}
        #: Im2col results read only as a GEMM's left operand (their Im2col body): the GEMM is torch's
        #: convolution of the Im2col's input, and the patches are never stored
        self.convolved: Mapping[str, Expr] = convolved or {}
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

    def bind(self, name: str, array: np.ndarray, addr: int | None = None) -> None:
        """Let the kernels read (write) ``array`` as tensor ``name``; ``addr``: its address, where known (numpy's
        ``ctypes`` is a costly call right after a kernel)."""
        self.arrays[name] = array
        self.addr[name] = array.__array_interface__["data"][0] if addr is None else addr

    def restore(self, name: str) -> None:
        self.arrays[name] = self.own[name]
        self.addr[name] = self._own_addr[name]

    def hand_over(self, name: str, array: np.ndarray, is_output: bool) -> None:
        """Tensor ``name`` as a library wrote it (a fresh array over torch's memory, of the tensor's shape or its
        rows): copied into a plan output's own array, else bound for the readers as it lies."""
        if is_output:
            np.copyto(self.arrays[name], array.reshape(self.arrays[name].shape))
        else:
            self.bind(name, array.reshape(self.own[name].shape))


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


def gemm_products(plan: Plan) -> dict[str, tuple[int, int, int]]:
    """Each GEMM kernel's right operand (a tensor it loads) and its product's (M, K, N): the largest product where
    several read it."""
    products: dict[str, tuple[int, int, int]] = {}
    for k in plan.kernels:
        mm = find_matmul(k.body) if k.kind in (KernelKind.GEMM_EPILOGUE, KernelKind.CUBLASLT) else None
        if mm is None or not isinstance(mm.args[1], Load):
            continue
        b = mm.args[1].tensor
        shape = (math.prod(mm.type.shape[:-1]), int(plan.tensors[b].shape[0]), int(mm.type.shape[-1]))
        if math.prod(shape) > math.prod(products.get(b, (0,))):
            products[b] = shape
    return products


def small_products(plan: Plan, min_macs: int) -> frozenset[str]:
    """Right operands of a GEMM kernel whose product has fewer than ``min_macs`` multiply-adds: oneDNN's packed
    product costs a fixed 15 µs or so a call (one Zen 4 core), the library's plain one 2 (``gemm.PACK_MIN_MACS``)."""
    return frozenset(b for b, shape in gemm_products(plan).items() if math.prod(shape) < min_macs)


def weights_fact(b_buf: np.ndarray) -> str:
    """A GEMM kernel's ``weights`` fact: "padded" where its right operand's buffer has padded rows."""
    return "padded" if b_buf.strides[0] != b_buf.shape[1] * b_buf.itemsize else "as stored"


#: the step implementations that call numpy's BLAS
BLAS_IMPLS = ("numpy-gemm", "numpy-batched-gemm", "numpy-reference")



"""How the CPU backend lays out its buffers: 64-byte aligned, and GEMM weights with padded rows.

numpy aligns its arrays to 16 bytes only; every buffer of a plan is aligned to a cache line instead
(:func:`aligned_empty`).  A matrix whose row stride is a multiple of 4 KiB (or of a large power of two of
cache lines) maps the rows a GEMM library packs together onto a few L1 sets, which evict each other:
:func:`padded_matrix` gives a matrix rows an odd number of cache lines apart, so consecutive rows fall
into every set.  With GPT-2's and a 2048-wide MLP's weights stored so, MKL and OpenBLAS multiplied
1.1-1.6x faster than from nn.Linear's own layout or a C-ordered copy (one core, Sapphire Rapids,
2026-12-03; ``docs/backends.md``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

#: bytes every buffer of a plan is aligned to: a cache line, and the row loads of AMX tiles and AVX-512 vectors.
#: numpy aligns to 16 bytes only; oneDNN's bf16 product read its operand 1.5x slower from such a buffer than
#: from a torch-allocated (64-byte aligned) copy of it (128x3072x768 on one core here, 2026-12-02).
ALIGN = 64


def aligned_empty(shape: Sequence[int], dtype: Any, zero: bool = False) -> np.ndarray:
    """An uninitialised (``zero``: zeroed) C-ordered array whose data start on an :data:`ALIGN`-byte boundary."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    raw = (np.zeros if zero else np.empty)(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dt).reshape(tuple(shape))


def typed_view(raw: np.ndarray, shape: Sequence[int], dtype: Any) -> np.ndarray:
    """The first bytes of byte buffer ``raw`` as a C-ordered ``shape`` array of ``dtype``."""
    dt = np.dtype(dtype)
    return raw[:math.prod(shape) * dt.itemsize].view(dt).reshape(tuple(shape))


def shared_buffers(steps: Sequence[tuple[str, Sequence[str]]], nbytes: Mapping[str, int]) -> dict[str, np.ndarray]:
    """One aligned byte buffer per tensor of ``nbytes`` (the intermediates), tensors whose lifetimes do not
    overlap sharing one: ``steps`` are the kernels in order, (tensor written, tensors read). A tensor is live
    from its writer to its last reader; a kernel's output never shares with what that kernel reads. Each
    buffer is taken best fit from those freed so far, else allocated: a transformer layer's intermediates then
    touch a few buffers that stay in cache between its kernels, instead of one cold buffer per tensor."""
    last_read = {t: i for i, (_, reads) in enumerate(steps) for t in reads if t in nbytes}
    free: list[np.ndarray] = []
    out: dict[str, np.ndarray] = {}
    for i, (written, reads) in enumerate(steps):
        if written in nbytes:
            need = nbytes[written]
            fits = [j for j, b in enumerate(free) if b.nbytes >= need]
            best = min(fits, key=lambda j: free[j].nbytes) if fits else None
            buf = free.pop(best) if best is not None else aligned_empty((need,), np.uint8, zero=True)
            out[written] = buf
            if written not in last_read:  # never read: free once written
                free.append(buf)
        for t in dict.fromkeys(reads):
            if last_read.get(t) == i:
                free.append(out[t])
    return out


def padded_row_elements(cols: int, itemsize: int) -> int:
    """Elements from one row's start to the next in a :func:`padded_matrix`: the row rounded up to whole
    cache lines, plus one line where their count is even."""
    lines = -(-cols * itemsize // ALIGN)
    lines += 1 - lines % 2
    return lines * ALIGN // itemsize


def padded_matrix(rows: int, cols: int, dtype: Any, zero: bool = False) -> np.ndarray:
    """A (rows, cols) view, rows :func:`padded_row_elements` apart, of an aligned (zeroed) buffer."""
    dt = np.dtype(dtype)
    stride = padded_row_elements(cols, dt.itemsize)
    return aligned_empty((rows, stride), dt, zero)[:, :cols]


class HeldWeights:
    """Forms of read-only matrices (a module's bound parameters) that GEMM libraries multiply faster, made once
    per array and form and shared by every plan one backend compiles: a search's candidates all read the same
    weights, and remaking them per candidate cost more than timing it.  Two forms: fp32 copies with padded rows,
    and 16-bit weights packed by oneDNN (``gemm.pack_weight``).  A form lives as long as the array it was made
    from."""

    def __init__(self) -> None:
        self._forms: dict[tuple[int, str], tuple[weakref.ref[np.ndarray], Any]] = {}
        self.copies = 0  # forms made so far (tests count them)

    def padded(self, arr: np.ndarray) -> tuple[np.ndarray, bool]:
        """(the padded fp32 copy of ``arr``, whether it was made by this call)."""
        def copy() -> np.ndarray:
            rows, cols = arr.shape
            out = padded_matrix(rows, cols, np.float32)
            np.copyto(out, arr)
            out.setflags(write=False)  # as its source: what is derived from it (a reordered weight) is kept
            return out

        return self.form(arr, "padded", copy)

    def form(self, arr: np.ndarray, kind: str, make: Callable[[], Any]) -> tuple[Any, bool]:
        """(the ``kind`` form of ``arr``, ``make()`` the first time it is asked for; whether this call made it)."""
        key = (id(arr), kind)
        hit = self._forms.get(key)
        if hit is not None and hit[0]() is arr:
            return hit[1], False
        made = make()
        self._forms[key] = (weakref.ref(arr, self._forget), made)
        self.copies += 1
        return made, True

    def _forget(self, ref: weakref.ref[np.ndarray]) -> None:
        """The array a form was made from is gone: drop its forms."""
        for key, (r, _) in list(self._forms.items()):
            if r is ref:
                del self._forms[key]

"""Which library multiplies a GEMM kernel's tiles: numpy's BLAS or torch's (``torch.mm``).

The generated C epilogue runs on each fp32 tile either way; only the product comes from the library.
torch's x86 wheels ship MKL, numpy's OpenBLAS: on one core here (fp32, 2026-12-01) MKL reached
74-80 GFLOP/s on GPT-2's MLP shapes (128x768x3072, 128x3072x768) against OpenBLAS's 52-63, and 51-87
against 27-55 on the 16-64-row tiles of a split GEMM; 64x2048x2048 was a tie.

``FUSION_PLANNER_CPU_GEMM``: ``auto`` (the default) takes torch when it is already imported (a torch model
is being planned, so it costs nothing to load), else numpy; ``torch`` and ``numpy`` force one.

16-bit operands are widened to fp32 for the product, except where torch multiplies their dtype in the
CPU's own instructions (bf16 on AMX or AVX-512 BF16, fp16 on AMX-FP16): there torch's product reads the
stored bits into a tile of the storage dtype, which the epilogue reads (the product rounded once, as
eager torch rounds a Linear's output).  On a Sapphire Rapids core (2026-12-02) bf16 ``torch.mm`` was 5.4x (128x768x3072) and
7.2x (1024x768x3072) faster than fp32; fp16 without AMX-FP16 was no faster than fp32, so it is widened.
``FUSION_PLANNER_CPU_GEMM_16BIT``: ``auto`` (the default) decides as above, ``widen`` widens every 16-bit
product, ``native`` takes torch's on any CPU (where it has no 16-bit units torch converts inside, slowly: for
tests and comparisons).  The same choice covers 16-bit batched products and attention (``standalone.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import numpy as np

from fusion_planner.backends.base import BackendError

GEMM_ENV = "FUSION_PLANNER_CPU_GEMM"
GEMM_16BIT_ENV = "FUSION_PLANNER_CPU_GEMM_16BIT"
LIBRARIES = ("numpy", "torch")
#: the torch.cpu capability checks under which torch multiplies a 16-bit dtype natively
_NATIVE_16BIT = {"bf16": ("_is_amx_tile_supported", "_is_avx512_bf16_supported"), "fp16": ("_is_amx_fp16_supported",)}
#: ``mm(a, b, out)``: ``out[:] = a @ b`` for fp32 C-contiguous 2-D arrays
MatMul = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def library_from_env(choice: str | None = None) -> str:
    """The GEMM library a backend uses: ``choice``, else ``$FUSION_PLANNER_CPU_GEMM``, else ``auto``."""
    what = "gemm_library" if choice else GEMM_ENV
    value = (choice or os.environ.get(GEMM_ENV) or "auto").strip().lower()
    if value == "auto":
        return "torch" if "torch" in sys.modules else "numpy"
    if value not in LIBRARIES:
        raise BackendError(f"{what}={value!r}: expected auto, numpy or torch")
    if value == "torch":
        try:
            import torch  # noqa: F401  (optional dependency)
        except ImportError as exc:
            raise BackendError(f"{what}=torch, but torch cannot be imported ({exc})") from None
    return value


def numpy_mm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b, out=out)


def torch_mm() -> MatMul:
    """``torch.mm`` on zero-copy views of the arrays (torch is imported: :func:`library_from_env` checked)."""
    import torch  # optional dependency

    from fusion_planner.torch.ops import numpy_view

    def mm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        torch.mm(numpy_view(a), numpy_view(b), out=torch.from_numpy(out))

    return mm


def native_16bit(dtype: str) -> bool:
    """Does torch multiply ``dtype`` in the CPU's own instructions here, so a GEMM need not widen it to fp32?
    (torch is imported: the caller uses the torch library.)"""
    value = (os.environ.get(GEMM_16BIT_ENV) or "auto").strip().lower()
    if value not in ("auto", "native", "widen"):
        raise BackendError(f"{GEMM_16BIT_ENV}={value!r}: expected auto, native or widen")
    if value == "widen" or dtype not in _NATIVE_16BIT:
        return False
    if value == "native":
        return True
    import torch  # optional dependency

    return any(getattr(torch.cpu, check, lambda: False)() for check in _NATIVE_16BIT[dtype])


def torch_mm_16bit(dtype: str) -> MatMul:
    """``mm(a, b, out)`` for operands and product held as 16-bit bit patterns (``uint16`` arrays of ``dtype``):
    torch's native product, rounded to ``dtype``."""
    import torch  # optional dependency

    from fusion_planner.torch.ops import numpy_view

    kind = torch.bfloat16 if dtype == "bf16" else torch.float16

    def mm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        torch.mm(numpy_view(a).view(kind), numpy_view(b).view(kind), out=torch.from_numpy(out).view(kind))

    return mm


def matmul(library: str) -> MatMul:
    return torch_mm() if library == "torch" else numpy_mm

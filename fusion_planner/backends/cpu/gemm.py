"""Which library multiplies a GEMM kernel's tiles: numpy's BLAS or torch's (``torch.mm``).

The generated C epilogue runs on each fp32 tile either way; only the product comes from the library.
torch's x86 wheels ship MKL, numpy's OpenBLAS: on one core here (fp32, 2026-12-01) MKL reached
74-80 GFLOP/s on GPT-2's MLP shapes (128x768x3072, 128x3072x768) against OpenBLAS's 52-63, and 51-87
against 27-55 on the 16-64-row tiles of a split GEMM; 64x2048x2048 was a tie.

``FUSION_PLANNER_CPU_GEMM``: ``auto`` (the default) takes torch when it is already imported (a torch model
is being planned, so it costs nothing to load), else numpy; ``torch`` and ``numpy`` force one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import numpy as np

from fusion_planner.backends.base import BackendError

GEMM_ENV = "FUSION_PLANNER_CPU_GEMM"
LIBRARIES = ("numpy", "torch")
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


def matmul(library: str) -> MatMul:
    return torch_mm() if library == "torch" else numpy_mm

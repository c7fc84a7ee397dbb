"""The float dtypes a tensor is stored in, each described once.

A :class:`DType` holds every fact the planner needs about one storage dtype: its size, its numpy
storage (bf16 through ml_dtypes), torch's name for it, the tolerance a result stored in it is judged
by (``planner.core.tolerance``), and the snippet that rounds an fp32 register value to it (each
backend's prelude defines ``fp_round_bf16`` and ``fp_round_f16``).  Graphs, plans and files spell a
dtype by its ``name``; :func:`dtype` turns the name into the record.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from planner.core.errors import OpError


@dataclass(frozen=True)
class DType:
    name: str
    bytes: int
    numpy: np.dtype
    #: ``torch.<torch_name>`` is this dtype
    torch_name: str
    #: (rtol, atol) of a result stored in this dtype; docs/rules.md explains the numbers
    rtol: float
    atol: float
    #: a C expression over ``{}``: an fp32 value rounded to this dtype (to nearest even), still in fp32
    round_c: str

    @property
    def max_finite(self) -> float:
        return float(ml_dtypes.finfo(self.numpy).max)

    def round(self, x: np.ndarray) -> np.ndarray:
        """Round float values to this dtype the way a store to global memory does (kept in ``x``'s dtype)."""
        return np.asarray(x).astype(self.numpy).astype(x.dtype)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        # fp32 registers everywhere: only summation order and FMA differ between backends
        DType("fp32", 4, np.dtype(np.float32), "float32", 1e-4, 1e-5, "({})"),
        # 2^-11 unit roundoff: about 10 ulp relative, 2 ulp of the tensor's magnitude absolute
        DType("fp16", 2, np.dtype(np.float16), "float16", 1e-2, 2e-3, "fp_round_f16({})"),
        # 2^-8 unit roundoff: about 6 ulp relative, 2.5 ulp of the tensor's magnitude absolute
        DType("bf16", 2, np.dtype(ml_dtypes.bfloat16), "bfloat16", 5e-2, 2e-2, "fp_round_bf16({})"),
    )
}


def dtype(name: str) -> DType:
    """The dtype ``name``; an unknown one is an error naming the known ones."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise OpError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def numpy_dtype(name: str) -> np.dtype:
    """The numpy storage dtype of one of our dtypes (bf16 through ml_dtypes)."""
    return dtype(name).numpy


def round_to(x: np.ndarray, name: str) -> np.ndarray:
    """Round float values to dtype ``name`` the way a store to global memory does."""
    return dtype(name).round(x)


__all__ = ["DTYPES", "DType", "dtype", "numpy_dtype", "round_to"]

"""Lowerings of products: ``nn.Linear`` / ``F.linear``, ``matmul``, ``addmm`` and the batched products of attention."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from planner.torch.binding import TORCH_DTYPES
from planner.torch.lowerings.layouts import settle, transposed_heads
from planner.torch.lowerings.registry import lowering
from planner.torch.walk import (
    Importer,
    Traced,
    head_major_shape,
    is_leaf_tensor,
    is_tensor,
)


@lowering("linear", becomes="MatMul (weight read transposed), BiasAdd")
def lower_linear(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    x = args[0]
    w = kwargs.get("weight", args[1] if len(args) > 1 else None)
    bias = kwargs.get("bias", args[2] if len(args) > 2 else None)
    if not isinstance(x, Traced) or len(x.shape) < 2 or not is_leaf_tensor(w) or len(w.shape) != 2:
        return None
    if bias is not None and (not is_leaf_tensor(bias) or len(bias.shape) != 1):
        return None
    wname = w.name if isinstance(w, Traced) else f"{node.name}_weight"
    mm = imp.emit(node, "MatMul", [imp.use(x, node.name), imp.use(w, wname, transpose=True)], None,
                   concrete.shape, concrete.dtype, suffix="_mm" if bias is not None else "")
    if bias is None:
        return mm
    bname = bias.name if isinstance(bias, Traced) else f"{node.name}_bias"
    return imp.emit(node, "BiasAdd", [mm.id, imp.use(bias, bname)], None, concrete.shape, concrete.dtype)


@lowering("matmul", becomes="MatMul (a 2-D right operand); BatchScores, BatchApply (attention's 4-D products)")
def lower_matmul(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    """``x @ w`` with ``w`` 2-D (a weight, or any stored matrix): one MatMul on ``x``'s rows.  Eager
    attention's 4-D products of head-major values: ``q @ k.transpose(-1, -2)`` is ``BatchScores``,
    ``p @ v`` is ``BatchApply``."""
    if len(args) != 2 or kwargs:
        return None
    if isinstance(concrete, torch.Tensor) and concrete.dim() == 4:
        return batched(imp, node, args[0], args[1], concrete)
    return gemm(imp, node, args[0], args[1], None, concrete)


def batched(imp: Importer, node: fx.Node, a: Any, b: Any, concrete: torch.Tensor) -> Traced | None:
    if not (isinstance(a, Traced) and isinstance(b, Traced) and a.dtype == b.dtype == concrete.dtype in TORCH_DTYPES):
        return None
    a = settle(imp, a)
    if a.id is None or imp.b.shape_of(a.id) != head_major_shape(a.shape):
        return None
    keys = transposed_heads(imp, node, b)
    if keys is not None:  # q @ k^T
        return imp.emit(node, "BatchScores", [a.id, keys], {"causal": 0}, concrete.shape, concrete.dtype)
    b = settle(imp, b)
    if b.id is not None and imp.b.shape_of(b.id) == head_major_shape(b.shape):  # p @ v
        return imp.emit(node, "BatchApply", [a.id, b.id], None, concrete.shape, concrete.dtype)
    return None


@lowering("addmm", becomes="MatMul, BiasAdd (GPT-2's Conv1D)")
def lower_addmm(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    """``torch.addmm(b, x, w)`` (GPT-2's Conv1D) with a row-vector ``b``: MatMul + BiasAdd."""
    if len(args) != 3 or any(kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or set(kwargs) - {"beta", "alpha"}:
        return None
    bias, x, w = args
    if not is_tensor(bias) or len(bias.shape) != 1:
        return None
    return gemm(imp, node, x, w, bias, concrete)


def gemm(imp: Importer, node: fx.Node, x: Any, w: Any, bias: Any, concrete: Any) -> Traced | None:
    if not (isinstance(x, Traced) and len(x.shape) >= 2 and is_tensor(w) and len(w.shape) == 2
            and isinstance(concrete, torch.Tensor) and x.dtype == w.dtype == concrete.dtype):
        return None
    wname = w.name if isinstance(w, Traced) else f"{node.name}_weight"
    mm = imp.emit(node, "MatMul", [imp.use(x, node.name), imp.use(w, wname)], None,
                   concrete.shape, concrete.dtype, suffix="_mm" if bias is not None else "")
    if bias is None:
        return mm
    bname = bias.name if isinstance(bias, Traced) else f"{node.name}_bias"
    return imp.emit(node, "BiasAdd", [imp.use(mm, node.name), imp.use(bias, bname)], None, concrete.shape, concrete.dtype)

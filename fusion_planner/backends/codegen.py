"""What the C and the CUDA code generators share: walking a kernel body, its snippets and operands.

A kernel body is an :class:`~fusion_planner.core.plans.Expr` tree over :class:`Load` leaves.
Both generators emit one statement per inner node, in dependency order, from the op table's
``code`` snippet; they read each loaded tensor either at the output's own index or, for a
row vector broadcast over the rows (a bias), at the column index; a GEMM kernel holds
exactly one MatMul whose operands come from memory.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Literal

from fusion_planner.backends.base import BackendError
from fusion_planner.core.kinds import OpKind
from fusion_planner.core.ops import op_def
from fusion_planner.core.plans import Expr, Load

Broadcast = Literal["full", "col"]


class CodegenError(BackendError):
    """A kernel body a code generator cannot express (the message says why)."""


def loads(body: Expr) -> list[str]:
    """The tensors a body loads, in first-use order (the order both generators number parameters)."""
    order: list[str] = []
    for e in body.walk():
        for a in e.args:
            if isinstance(a, Load) and a.tensor not in order:
                order.append(a.tensor)
    return order


def nodes_to_emit(body: Expr, given: Collection[int] = ()) -> list[Expr]:
    """The inner nodes of ``body`` in dependency order, each once, without those whose value the caller
    already holds (``given``: ids, e.g. the GEMM accumulator); each has a code snippet."""
    out = []
    for e in body.walk():
        if id(e) in given:
            continue
        if op_def(e.op).code is None:
            raise CodegenError(f"op {e.op} (node {e.node!r}) has no code snippet; it cannot be fused here")
        out.append(e)
    return out


def snippet(e: Expr, args: Sequence[str]) -> str:
    """The C expression of node ``e`` over its argument expressions (the op table's snippet)."""
    code = op_def(e.op).code
    assert code is not None  # nodes_to_emit checked it
    return code(list(args), e.attr_dict)


def broadcast(shape: Sequence[int], out_shape: Sequence[int], tensor: str) -> Broadcast:
    """How an operand is indexed inside a loop over the output: its own layout, or a row vector."""
    if tuple(shape) == tuple(out_shape):
        return "full"
    if len(shape) == 1 and len(out_shape) >= 1 and shape[0] == out_shape[-1]:
        return "col"
    raise CodegenError(f"operand {tensor!r} of shape {list(shape)} does not broadcast to {list(out_shape)}")


def find_matmul(body: Expr) -> Expr:
    """The one MatMul of a GEMM kernel's body, with both operands loaded from memory."""
    mms = [e for e in body.walk() if op_def(e.op).kind == OpKind.MATMUL]
    if len(mms) != 1:
        raise CodegenError(f"GEMM kernel for node {body.node!r} holds {len(mms)} MatMuls; expected 1")
    mm = mms[0]
    if not all(isinstance(a, Load) for a in mm.args):
        raise CodegenError(f"MatMul {mm.node!r}: operands must be loaded from memory (no prologue fusion)")
    return mm

"""What the C and the CUDA code generators share: walking a kernel body, its snippets and operands.

A kernel body is an :class:`~planner.core.plans.Expr` tree over :class:`Load` leaves.
Both generators emit one statement per inner node, in dependency order, from the op table's
``code`` snippet; they read each loaded tensor at the output's own index, at the column index
(a row vector broadcast over the rows: a bias), at the row index modulo its rows (a tile of
trailing dimensions broadcast over the leading ones: RoPE's cos and sin), or, under
``RotateHalf``, at the other half's column, negated in the first half; a GEMM kernel holds
exactly one MatMul whose operands come from memory.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from planner.backend import BackendError
from planner.core.kinds import OpKind
from planner.core.ops import Reduction, float_literal, op_def
from planner.core.plans import Expr, Load

Broadcast = Literal["full", "col", "wrap", "group"]

#: the op whose input is read at the other half of the row (negated in the first half): RoPE's rotate_half
ROTATE_HALF = "RotateHalf"


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
    """How an operand is indexed inside a loop over the output: its own layout, a row vector, or a tile of the
    output's trailing dimensions (its rows repeated: ``wrap``)."""
    if tuple(shape) == tuple(out_shape):
        return "full"
    if len(shape) == 1 and len(out_shape) >= 1 and shape[0] == out_shape[-1]:
        return "col"
    if 2 <= len(shape) < len(out_shape) and tuple(out_shape[len(out_shape) - len(shape):]) == tuple(shape):
        return "wrap"
    if is_group_row(shape, out_shape):
        return "group"
    raise CodegenError(f"operand {tensor!r} of shape {list(shape)} does not broadcast to {list(out_shape)}")


def is_group_row(shape: Sequence[int], out_shape: Sequence[int]) -> bool:
    """Is ``shape`` one row per group of output rows: (G, 1, T) of an output (G, S, T) (an attention mask), or
    (G, T) of (G*S, T) rows (an image's channel weights over its pixels' rows)? Read as ``group``."""
    if len(shape) == 2 == len(out_shape):
        return shape[1] == out_shape[1] and shape[0] < out_shape[0] and out_shape[0] % shape[0] == 0
    return (len(shape) == 3 == len(out_shape) and shape[1] == 1 and out_shape[1] != 1
            and shape[0] == out_shape[0] and shape[2] == out_shape[2])


def group_rows(shape: Sequence[int], out_shape: Sequence[int]) -> int:
    """The output rows one row of a ``group`` operand of ``shape`` covers (:func:`is_group_row`)."""
    return int(out_shape[1]) if len(out_shape) == 3 else int(out_shape[0]) // int(shape[0])


def tile_rows(shape: Sequence[int]) -> int:
    """The rows of a ``wrap`` operand: the product of all but its last dimension."""
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows


def is_rotated(e: Expr) -> bool:
    """Does ``e`` read its input at the other half of the row (``RotateHalf``)?  Its input is then a load."""
    if e.op != ROTATE_HALF:
        return False
    if not isinstance(e.args[0], Load):
        raise CodegenError(f"RotateHalf {e.node!r}: its input must be loaded from memory (it is read rotated)")
    return True


def find_matmul(body: Expr) -> Expr:
    """The one MatMul of a GEMM kernel's body, with both operands loaded from memory."""
    mms = [e for e in body.walk() if op_def(e.op).kind == OpKind.MATMUL]
    if len(mms) != 1:
        raise CodegenError(f"GEMM kernel for node {body.node!r} holds {len(mms)} MatMuls; expected 1")
    mm = mms[0]
    if not all(isinstance(a, Load) for a in mm.args):
        raise CodegenError(f"MatMul {mm.node!r}: operands must be loaded from memory (no prologue fusion)")
    return mm


# ---------------------------------------------------------------- row kernels
# A body holding a row reduction runs one row at a time: each reduction is a loop over the row, its
# elementwise producers computed inside that loop; the values of one per row (shape [..., 1]: the
# reductions and what is computed from them) are scalars of the row; the output is written by a last
# loop over the row (or once per row, for a per-row output).  Both generators emit the same C.

#: an fp32 array read at the row's column ``c``: contiguous along the row, so a vector loop can load it
_ARRAY_AT_C = re.compile(r"\w+\[[^\[\]]*\bc\]")

Level = Literal["full", "row", "col", "wrap", "rot", "group"]


def _shapes(body: Expr, load_shapes: Mapping[str, Sequence[int]]) -> list[Sequence[int]]:
    out: list[Sequence[int]] = []
    for e in body.walk():
        out.append(e.type.shape)
        out += [load_shapes[a.tensor] for a in e.args if isinstance(a, Load) and a.tensor in load_shapes]
    return out


def is_row_kernel(body: Expr, load_shapes: Mapping[str, Sequence[int]]) -> bool:
    """Does the body run row by row: it holds a row reduction, or reads or computes one value per row
    (shape [..., 1]) beside full rows?"""
    if any(op_def(e.op).kind == OpKind.REDUCTION for e in body.walk()):
        return True
    lasts = {int(s[-1]) for s in _shapes(body, load_shapes) if len(s) > 1}
    return 1 in lasts and len(lasts) > 1


def row_width(body: Expr, load_shapes: Mapping[str, Sequence[int]]) -> int:
    """The length of the rows a row kernel runs over: the longest last dimension in the body."""
    return max(int(s[-1]) for s in _shapes(body, load_shapes) if len(s) >= 1)


@dataclass
class RowEmitter:
    """Emits the statements of one row of a row kernel; ``load(tensor, level)`` is the generator's
    expression reading a loaded tensor at the row (``row``), the column (``col``) or both (``full``)."""

    width: int
    level_of: Callable[[str], Level]
    load: Callable[[str, Level], str]
    lanes: int  # partial results per reduction: 16 (one vector, the C prelude's fp_v16) or 1 (a CUDA thread)
    #: rows up to this long keep a reduction's input that a later loop reads too (LayerNorm's ``x + r``,
    #: softmax's ``exp(x - max)``) in a row buffer (0: never), so it is not computed again.  An input
    #: nothing else reads (RMSNorm's ``x * x``) is computed in the loop over the partials: storing it
    #: and reading it back cost RMSNorm 3.5 ms against 2.8 ms on 2048 rows of 2048 with cold caches
    buffer_limit: int = 0
    #: threads sharing one row (a CUDA block per row: thread t takes columns t, t + threads, ...; the
    #: reductions combine across the warp by shuffles, then across warps in ``fp_red``); 0: a row per thread
    threads: int = 0
    lines: list[str] = field(default_factory=list)
    _row: dict[int, str] = field(default_factory=dict)
    _buffers: dict[int, str] = field(default_factory=dict)
    _readers: dict[int, int] = field(default_factory=dict)  # how many nodes of the body read each node
    _count: int = 0

    def _name(self, stem: str = "v") -> str:
        self._count += 1
        return f"{stem}{self._count}"

    @staticmethod
    def per_row(e: Expr) -> bool:
        return op_def(e.op).kind == OpKind.REDUCTION or int(e.type.shape[-1]) == 1

    def row_value(self, e: Expr | Load) -> str:
        """A variable of the row scope holding ``e`` (one value per row)."""
        key = id(e)
        if key in self._row:
            return self._row[key]
        if isinstance(e, Load):
            expr = self.load(e.tensor, "row")
        elif op_def(e.op).kind == OpKind.REDUCTION:
            expr = self._reduce(e)
        else:
            expr = snippet(e, [self.row_value(a) for a in e.args])
        name = self._name()
        self.lines.append(f"const float {name} = {expr};")
        self._row[key] = name
        return name

    def loop_value(self, e: Expr | Load, scope: dict[int, str], body: list[str]) -> str:
        """An expression for ``e`` at column ``c`` inside a loop over the row (``scope``: its variables)."""
        if isinstance(e, Load):
            level = self.level_of(e.tensor)
            return self.row_value(e) if level == "row" else self.load(e.tensor, level)
        if is_rotated(e):
            return self.load(e.args[0].tensor, "rot")  # type: ignore[union-attr]
        if self.per_row(e):
            return self.row_value(e)
        if id(e) in self._buffers:
            return f"{self._buffers[id(e)]}[c]"
        if id(e) not in scope:
            args = [self.loop_value(a, scope, body) for a in e.args]
            scope[id(e)] = name = self._name()
            body.append(f"const float {name} = {snippet(e, args)};")
        return scope[id(e)]

    def _reduce(self, e: Expr) -> str:
        red = op_def(e.op).reduction
        if red is None:
            raise CodegenError(f"op {e.op} (node {e.node!r}) is a reduction with no start value and combine in the "
                               "op table (OpDef.reduction)")
        init = float_literal(red.identity)
        body: list[str] = []
        value = self.loop_value(e.args[0], {}, body)
        reread = self._readers.get(id(e.args[0]), 0) > 1
        if (body or not _ARRAY_AT_C.fullmatch(value)) and reread and self.width <= self.buffer_limit:
            buf = self._name("row")
            self.lines += [f"float {buf}[{self.width}];", f"for (long long c = 0; c < {self.width}; ++c) {{",
                           *(f"    {s}" for s in body), f"    {buf}[c] = {value};", "}"]
            self._buffers[id(e.args[0])] = buf
            body, value = [], f"{buf}[c]"
        acc = self._name("acc")
        if self.threads:
            self.lines += self._cooperative_partials(acc, body, value, init, red.combine)
            return red.finish.format(acc=acc, width=self.width)
        vector = red.vector is not None and self.lanes == 16 and not body and self.width >= 16
        if vector and _ARRAY_AT_C.fullmatch(value):
            self.lines += self._vector_partials(acc, value, init, red)
        else:
            self.lines += self._scalar_partials(acc, body, value, init, red.combine)
        return red.finish.format(acc=acc, width=self.width)

    def _vector_partials(self, acc: str, value: str, init: str, red: Reduction) -> list[str]:
        """One vector of partials over a contiguous fp32 row (``value`` is an array read at ``c``): the C
        prelude's ``fp_va``, ``FP_VL`` lanes (16, or 8 where the target has AVX2 but not AVX-512: gcc kept a
        64-byte vector carried through the loop on the stack there), merged pairwise in a tree of lane exchanges
        at the end (``fp_va_swap``: in registers); through the reduction's ``quiet`` combine where it has one,
        with a vector of marks of the lanes that read a NaN beside it (a NaN mark makes the result NaN)."""
        assert red.vector is not None
        part, w = self._name("part"), self.width
        end = w // 16 * 16
        load = f"fp_va_load(&{value[:-2]}c0])"
        swap = f"fp_va_swap({part}, h)"
        if red.quiet is None:
            lines = [f"fp_va {part} = fp_va_fill({init});",
                     f"for (long long c0 = 0; c0 < {end}; c0 += FP_VL) {part} = {red.vector.format(a=part, b=load)};",
                     f"for (int h = FP_VL / 2; h >= 1; h /= 2) {part} = {red.vector.format(a=part, b=swap)};",
                     f"float {acc} = {part}[0];"]
        else:  # the NaN marks merge in a tree of their own
            nan, x = f"{part}nan", f"{part}x"
            lines = [f"fp_va {part} = fp_va_fill({init});", f"fp_vai {nan} = fp_va_isnan({part});",
                     f"for (long long c0 = 0; c0 < {end}; c0 += FP_VL) {{", f"    const fp_va {x} = {load};",
                     f"    {part} = {red.quiet.format(a=part, b=x)};", f"    {nan} |= fp_va_isnan({x});", "}",
                     "for (int h = FP_VL / 2; h >= 1; h /= 2) {",
                     f"    {part} = {red.quiet.format(a=part, b=swap)};", f"    {nan} |= fp_vai_swap({nan}, h);", "}",
                     f"float {acc} = {nan}[0] ? fp_bits_f32(0x7fc00000u) : {part}[0];"]
        if w % 16:
            lines.append(f"for (long long c = {end}; c < {w}; ++c) {acc} = {red.combine.format(a=acc, b=value)};")
        return lines

    def _scalar_partials(self, acc: str, body: list[str], value: str, init: str, combine: str) -> list[str]:
        """``lanes`` partials in an array, the value computed in the loop (a CUDA thread's row, or a row too
        long for a buffer)."""
        part, lanes, w = self._name("part"), self.lanes, self.width
        end = w // lanes * lanes
        step = [*body, f"{part}[j] = {combine.format(a=f'{part}[j]', b=value)};"]
        lines = [f"float {part}[{lanes}];", f"for (long long j = 0; j < {lanes}; ++j) {part}[j] = {init};",
                 f"for (long long c0 = 0; c0 < {end}; c0 += {lanes}) {{",
                 f"    for (long long j = 0; j < {lanes}; ++j) {{", "        const long long c = c0 + j;",
                 *(f"        {s}" for s in step), "    }", "}"]
        if w % lanes:
            tail = [s.replace(f"{part}[j]", f"{part}[0]") for s in step]
            lines += [f"for (long long c = {end}; c < {w}; ++c) {{", *(f"    {s}" for s in tail), "}"]
        return lines + [f"float {acc} = {part}[0];",
                        f"for (long long j = 1; j < {lanes}; ++j) {acc} = {combine.format(a=acc, b=f'{part}[j]')};"]

    def _cooperative_partials(self, acc: str, body: list[str], value: str, init: str, combine: str) -> list[str]:
        """One partial per thread over its columns, combined across the warp (shuffles), then across the block's
        warps in ``fp_red``; every thread takes lane 0's and the warps' values in one order, so all hold the
        same bits (an exchange can disagree on the sign of a zero maximum)."""
        part, t = self._name("part"), self.threads
        lines = [f"float {part} = {init};", *self._column_loop([*body, f"{part} = {combine.format(a=part, b=value)};"]),
                 "for (int o = 16; o > 0; o >>= 1) {",
                 f"    const float other = __shfl_xor_sync(0xffffffffu, {part}, o);",
                 f"    {part} = {combine.format(a=part, b='other')};", "}",
                 f"{part} = __shfl_sync(0xffffffffu, {part}, 0);"]
        if t == 32:
            return [*lines, f"const float {acc} = {part};"]
        return [*lines, f"if ((threadIdx.x & 31) == 0) fp_red[threadIdx.x >> 5] = {part};", "__syncthreads();",
                f"float {acc} = fp_red[0];", f"for (int w = 1; w < {t // 32}; ++w) {acc} = {combine.format(a=acc, b='fp_red[w]')};",
                "__syncthreads();  // fp_red is written again by the next reduction"]

    def _column_loop(self, body: list[str]) -> list[str]:
        """A loop over this thread's columns of the row (all of them, or every ``threads``-th)."""
        head = (f"for (long long c = threadIdx.x; c < {self.width}; c += {self.threads}) {{" if self.threads
                else f"for (long long c = 0; c < {self.width}; ++c) {{")
        return [head, *(f"    {s}" for s in body), "}"]

    def output(self, root: Expr, store: Callable[[str, str], str]) -> list[str]:
        """The row's statements, ending with the store of the output (``store(value, index)``)."""
        for e in root.walk():
            for a in {id(a): a for a in e.args if isinstance(a, Expr)}.values():
                self._readers[id(a)] = self._readers.get(id(a), 0) + 1
        for e in root.walk():  # the row's values first, producers before consumers: the buffers they
            if self.per_row(e):  # leave exist before any later loop is written
                self.row_value(e)
        if self.per_row(root):
            value = self.row_value(root)
            return [*self.lines, ("if (threadIdx.x == 0) " if self.threads else "") + store(value, "r")]
        body: list[str] = []
        value = self.loop_value(root, {}, body)
        return [*self.lines, *self._column_loop([*body, store(value, f"r * {self.width} + c")])]


def row_level(shape: Sequence[int], width: int, rows: int, tensor: str, out_shape: Sequence[int] = ()) -> Level:
    """How a row kernel reads a tensor of ``shape``: one value per row, a row vector, the full row, or a row
    of a tile whose rows repeat over the kernel's (``wrap``)."""
    lead = tile_rows(shape)
    if len(shape) == 1 and shape[0] == width and rows != 1:
        return "col"
    if shape and shape[-1] == 1 and lead == rows:
        return "row"
    if shape and shape[-1] == width and lead == rows:
        return "full"
    if out_shape and is_group_row(shape, (*out_shape[:-1], width)):  # the rows' shape: a per-row output's too
        return "group"
    if len(shape) >= 2 and shape[-1] == width and rows % lead == 0:
        return "wrap"
    raise CodegenError(f"operand {tensor!r} of shape {list(shape)} is not read row by row over rows of {width}")


def row_read(level: Level, width: int, tile: int, read: Callable[[str], str], suffix: str = "") -> str:
    """A row kernel's float expression for one operand at column ``c`` of row ``r`` (``read(index)`` loads
    it); ``tile``: the rows of a ``wrap`` operand, or the output rows per group of a ``group`` one (its row
    is ``r / tile``); ``suffix``: of integer literals (CUDA's ``LL``).  A rotated read (``rot``) takes the other
    half's column, negated in the first half, as ``RotateHalf`` defines it."""
    if level == "group":
        return read(f"(r / {tile}{suffix}) * {width}{suffix} + c")
    w = f"{width}{suffix}"
    if level == "rot":
        half = f"{width // 2}{suffix}"
        value = read(f"r * {w} + (c + {half}) % {w}")
        return f"(c < {half} ? -{value} : {value})"
    index = {"full": f"r * {w} + c", "row": "r", "col": "c", "wrap": f"(r % {tile}{suffix}) * {w} + c"}[level]
    return read(index)

"""The op table: every op kind described once.

Each :class:`OpDef` holds, for one op kind, everything the rest of the planner
needs to know about it: its egglog constructor signature, its shape rule, its
numpy semantics, its ledger rules (FLOPs and live registers when fused) and the
C/CUDA code snippet that the generated kernels use.  Adding an op means adding
one entry to :data:`OPS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from planner.core.kinds import OpKind

Shape = tuple[int, ...]
Attrs = Mapping[str, Any]

#: bytes per element of each supported dtype
DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}


class OpError(ValueError):
    """An op was used with the wrong inputs, attributes or shapes."""


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy storage dtype of one of our dtypes (bf16 through ml_dtypes)."""
    if dtype == "fp16":
        return np.dtype(np.float16)
    if dtype == "fp32":
        return np.dtype(np.float32)
    if dtype == "bf16":

        return np.dtype(ml_dtypes.bfloat16)
    raise OpError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float values to ``dtype`` the way a store to global memory does."""
    return np.asarray(x).astype(numpy_dtype(dtype)).astype(x.dtype)


# ---------------------------------------------------------------- attributes


@dataclass(frozen=True)
class AttrSpec:
    """One attribute of an op: its name, egglog sort and default."""

    name: str
    sort: str  # "f64" | "i64" | "String"
    default: Any = None
    minimum: float | None = None  # smallest valid value of a numeric attribute
    choices: tuple[str, ...] = ()  # the valid values of a String attribute (any string when empty)

    def coerce(self, value: Any, op: str) -> Any:
        if value is None:
            if self.default is None:
                raise OpError(f"{op}: missing attribute {self.name!r}")
            value = self.default
        try:
            if self.sort == "f64":
                out = float(value)
                if not math.isfinite(out):
                    raise OpError(f"{op}: attribute {self.name!r} must be finite, got {value!r}")
                return self._at_least(out, op)
            if self.sort == "i64":
                if isinstance(value, bool) or int(value) != value or not -(2**63) <= int(value) < 2**63:
                    raise OpError(f"{op}: attribute {self.name!r} must be a 64-bit integer, got {value!r}")
                return self._at_least(int(value), op)
            if self.choices and str(value) not in self.choices:
                raise OpError(f"{op}: attribute {self.name!r} must be one of {list(self.choices)}, got {str(value)[:40]!r}")
            return str(value)
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, OpError):
                raise
            raise OpError(f"{op}: attribute {self.name!r} has bad value {str(value)[:40]!r}") from None

    def _at_least(self, value: Any, op: str) -> Any:
        if self.minimum is not None and value < self.minimum:
            raise OpError(f"{op}: attribute {self.name!r} must be at least {self.minimum:g}, got {value!r}")
        return value


# ---------------------------------------------------------------- shape rules


def same_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    first = shapes[0]
    for s in shapes[1:]:
        if s != first:
            raise OpError(f"{op}: input shapes differ: {list(first)} vs {list(s)}")
    return first


def _matmul_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    a, b = shapes
    if len(a) != 2 or len(b) != 2:
        raise OpError(f"{op}: expects 2-D inputs, got {list(a)} and {list(b)}")
    if a[1] != b[0]:
        raise OpError(f"{op}: inner dimensions differ: {list(a)} @ {list(b)}")
    return (a[0], b[1])


def _bias_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, bias = shapes
    if len(x) < 1 or len(bias) != 1 or bias[0] != x[-1]:
        raise OpError(
            f"{op}: bias must be 1-D with the input's last dimension, got {list(x)} + {list(bias)}"
        )
    return x


def _row_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    if len(x) < 1:
        raise OpError(f"{op}: reduces the last dimension of a tensor of rank >= 1, got a scalar")
    return (*x[:-1], 1)


def _tile_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, t = shapes
    if len(t) < 2 or len(x) <= len(t) or any(a != b for a, b in zip(x[len(x) - len(t):], t, strict=True)):
        raise OpError(f"{op}: the second input must be the trailing dimensions (two or more) of the first, "
                      f"broadcast over its leading ones, got {list(x)} and {list(t)}")
    return x


def _rotate_half_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    if not x or (isinstance(x[-1], int) and x[-1] % 2):  # symbolic dims (the rule checker's) have no parity
        raise OpError(f"{op}: rotates the two halves of an even last dimension, got {list(x)}")
    return x


def _per_row_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, r = shapes
    if len(r) != len(x) or len(x) < 1 or r[-1] != 1 or any(a != b for a, b in zip(x[:-1], r[:-1], strict=True)):
        raise OpError(f"{op}: the second input must be one value per row of the first (shape [..., 1]), "
                      f"got {list(x)} and {list(r)}")
    return x


def _heads_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    heads, seq, offset, width = (int(attrs[a]) for a in ("heads", "seq", "offset", "width"))
    if len(x) != 2 or x[0] % seq or offset + width > x[1] or width % heads:
        raise OpError(f"{op}: takes columns [{offset}, {offset + width}) of a 2-D tensor of rows (batch x {seq} "
                      f"tokens) as {heads} heads, got {list(x)}")
    return (x[0] // seq * heads, seq, width // heads)


def _merge_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (y,) = shapes
    heads = int(attrs["heads"])
    if len(y) != 3 or y[0] % heads:
        raise OpError(f"{op}: takes (batch x {heads} heads, tokens, head dim), got {list(y)}")
    return (y[0] // heads * y[1], heads * y[2])


def _batch_shape(op: str, shapes: Sequence[Shape], transpose_b: bool) -> Shape:
    a, b = shapes
    inner = b[2] if transpose_b else b[1]
    if len(a) != 3 or len(b) != 3 or a[0] != b[0] or a[2] != inner:
        rhs = "(G, T, K)" if transpose_b else "(G, K, N)"
        raise OpError(f"{op}: expects (G, S, K) and {rhs}, got {list(a)} and {list(b)}")
    return (a[0], a[1], b[1] if transpose_b else b[2])


def _attention_op_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    q, k, v = shapes[:3]
    scores = _batch_shape(op, [q, k], True)
    if len(shapes) == 4:
        _mask_shape(op, [scores, shapes[3]], attrs)
    return _batch_shape(op, [scores, v], False)


def _mask_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, m = shapes
    if len(x) != 3 or len(m) != 3 or m[0] != x[0] or m[1] != 1 or m[2] != x[2]:
        raise OpError(f"{op}: the mask must be one row of keys per group, (G, 1, T) for scores (G, S, T), "
                      f"got {list(m)} for {list(x)}")
    return x


def _group_repeat_shape(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (m,) = shapes
    heads, rows = int(attrs["heads"]), int(attrs["rows"])
    if len(m) == 3 and m[1] == rows:  # groups already: (kv heads, T, d) keys repeated for their query heads
        return (m[0] * heads, rows, m[2])
    if len(m) != 2 or m[0] % rows:
        raise OpError(f"{op}: takes (batch x {rows} rows, T) or (groups, {rows}, T), got {list(m)}")
    return (m[0] // rows * heads, rows, m[1])


# ---------------------------------------------------------------- semantics


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = x.dtype.type(math.sqrt(2.0 / math.pi))
    return x.dtype.type(0.5) * x * (1 + np.tanh(c * (x + x.dtype.type(0.044715) * x * x * x)))


def _erf(x: np.ndarray) -> np.ndarray:
    from scipy.special import erf  # imported on first use: it adds 0.4 s to every command's start

    return erf(x).astype(x.dtype)


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return x.dtype.type(0.5) * x * (1 + _erf(x / x.dtype.type(math.sqrt(2.0))))


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-x))


def _affine(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    a, b = float(attrs["a"]), float(attrs["b"])
    y = x if a == 1.0 else x.dtype.type(a) * x
    return y if b == 0.0 else y + x.dtype.type(b)


def _divide(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # ±inf and NaN are the values, as in torch
        return x / y


def _heads(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    heads, seq, offset, width = (int(attrs[a]) for a in ("heads", "seq", "offset", "width"))
    cols = x[:, offset:offset + width].reshape(-1, seq, heads, width // heads)
    return np.ascontiguousarray(cols.transpose(0, 2, 1, 3)).reshape(-1, seq, width // heads)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _merge(y: np.ndarray, attrs: Attrs) -> np.ndarray:
    heads = int(attrs["heads"])
    g, s, d = y.shape
    return np.ascontiguousarray(y.reshape(g // heads, heads, s, d).transpose(0, 2, 1, 3)).reshape(-1, heads * d)


def _causal(scores: np.ndarray) -> np.ndarray:
    """Scores with query i's keys after i set to -inf (torch's ``is_causal``: the top-left triangle kept)."""
    s, t = scores.shape[-2:]
    return np.where(np.triu(np.ones((s, t), dtype=bool), 1), scores.dtype.type(-np.inf), scores)


def _batch_scores(q: np.ndarray, k: np.ndarray, attrs: Attrs) -> np.ndarray:
    scores = np.matmul(q, np.swapaxes(k, -1, -2))
    return _causal(scores) if attrs["causal"] else scores


def _group_repeat(m: np.ndarray, attrs: Attrs) -> np.ndarray:
    heads, rows = int(attrs["heads"]), int(attrs["rows"])
    cols = m.shape[-1]
    b = m.size // (rows * cols)
    return np.ascontiguousarray(np.broadcast_to(m.reshape(b, 1, rows, cols), (b, heads, rows, cols))).reshape(
        b * heads, rows, cols)


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, attrs: Attrs, mask: np.ndarray | None = None) -> np.ndarray:
    s = _affine(_batch_scores(q, k, attrs), {"a": attrs["scale"], "b": 0.0})
    if mask is not None:
        s = s + mask
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(s - np.max(s, axis=-1, keepdims=True))
        return np.matmul(e / np.sum(e, axis=-1, keepdims=True), v)


def _elems(shape: Shape) -> int:
    return math.prod(shape)


# ---------------------------------------------------------------- code snippets
# A snippet maps input variable names (and attributes) to one C expression in
# float arithmetic.  The CPU (C) and CUDA backends share these strings.


def _c_float(v: float) -> str:
    return f"{float(v)!r}f".replace("inf", "INFINITY")


CodeFn = Callable[[Sequence[str], Attrs], str]


def _affine_c(v: Sequence[str], attrs: Attrs) -> str:
    """``a*x + b`` without its identity terms, as :func:`_affine` computes it: ``x*a`` (torch's scalar
    multiply) keeps a zero product's sign, and the compiler can contract ``x*a`` with a following
    ``+ b`` into one FMA, which ``x*a + 0.0f`` would prevent."""
    a, b = float(attrs["a"]), float(attrs["b"])
    y = v[0] if a == 1.0 else f"{_c_float(a)}*{v[0]}"
    return f"({y})" if b == 0.0 else f"({y} + {_c_float(b)})"


@dataclass(frozen=True)
class OpDef:
    """Everything the planner knows about one op kind."""

    name: str
    kind: OpKind
    arity: int | None  # tensor inputs; None for variadic (Opaque)
    attrs: tuple[AttrSpec, ...] = ()
    shape_rule: Callable[[str, Sequence[Shape], Attrs], Shape] | None = None
    #: the result's dtype, for an op whose result is not of its inputs' dtype (Cast); None: the inputs' one dtype
    dtype_rule: Callable[[Attrs], str] | None = None
    numpy_fn: Callable[[Sequence[np.ndarray], Attrs], np.ndarray] | None = None
    flops_per_elem: Callable[[Attrs], float] | None = None  # elementwise ops
    regs: Callable[[Attrs], int] = field(default=lambda attrs: 0)
    code: CodeFn | None = None
    #: input positions that may be read from registers (fused) rather than memory; each one gets the
    #: generated register-read, GEMM-epilogue and subsume rules (planner/rules/rulegen.py)
    fusable_inputs: tuple[int, ...] = ()
    #: which fusable inputs may come from a GEMM in registers (the generated epilogue rule): all (True),
    #: none (False) or the listed positions
    gemm_epilogue: bool | tuple[int, ...] = True
    #: canonical names of the torch callables this op is (``torch.square``, ``torch.Tensor.square``):
    #: the torch importer maps a call of one of them on a single tensor, with no other argument,
    #: to this op (only for ops with one input and no attributes)
    torch_names: tuple[str, ...] = ()
    #: FLOPs of ops whose count is not per element (Opaque: its implementation's rule)
    flops_rule: Callable[[Shape, Sequence[Shape], Attrs], float] | None = None
    #: a further check of the coerced attributes (Opaque: the implementation name and its call description)
    attr_check: Callable[[dict[str, Any]], None] | None = None
    #: live temporaries a code generator must keep (the C-05 register-pressure probe)
    probe_temps: Callable[[Attrs], int] = field(default=lambda attrs: 0)
    doc: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))  # a registered op may name its kind as a string

    def takes_gemm_input(self, i: int) -> bool:
        """May fusable input ``i`` come from a GEMM in registers (an epilogue rule)?"""
        return i in self.gemm_epilogue if isinstance(self.gemm_epilogue, tuple) else self.gemm_epilogue

    def check_attrs(self, attrs: Attrs) -> dict[str, Any]:
        known = {a.name for a in self.attrs}
        unknown = sorted(set(attrs) - known)
        if unknown and self.kind != OpKind.OPAQUE:
            raise OpError(f"{self.name}: unknown attribute(s) {unknown}")
        out = {a.name: a.coerce(attrs.get(a.name), self.name) for a in self.attrs}
        if self.kind == OpKind.OPAQUE:
            out.update({k: v for k, v in attrs.items() if k not in known})
        if self.attr_check is not None:
            self.attr_check(out)
        return out

    def out_shape(self, in_shapes: Sequence[Shape], attrs: Attrs) -> Shape:
        if self.arity is not None and len(in_shapes) != self.arity:
            raise OpError(f"{self.name}: expects {self.arity} input(s), got {len(in_shapes)}")
        assert self.shape_rule is not None
        return self.shape_rule(self.name, in_shapes, attrs)

    def out_dtype(self, in_dtypes: Sequence[str], attrs: Attrs) -> str | None:
        """The result's dtype: the ``dtype_rule``'s, else the inputs' (which must agree); None with no input."""
        if self.dtype_rule is not None:
            return self.dtype_rule(attrs)
        if len(set(in_dtypes)) > 1:
            raise OpError(f"{self.name}: mixed input dtypes {sorted(set(in_dtypes))}")
        return in_dtypes[0] if in_dtypes else None

    def evaluate(self, inputs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
        assert self.numpy_fn is not None, self.name
        return self.numpy_fn(inputs, attrs)

    def flops(self, out_shape: Shape, in_shapes: Sequence[Shape], attrs: Attrs) -> float:
        if self.kind == OpKind.MATMUL:
            (m, k), (_, n) = in_shapes
            return 2.0 * m * n * k
        if self.flops_rule is not None:
            return self.flops_rule(out_shape, in_shapes, attrs)
        if self.flops_per_elem is None:
            return 0.0
        return self.flops_per_elem(attrs) * _elems(out_shape)

    def live_regs(self, attrs: Attrs) -> int:
        return int(self.regs(attrs))


def _unary(
    name: str,
    fn: Callable[[np.ndarray], np.ndarray],
    flops: float,
    regs: int,
    code: CodeFn,
    doc: str,
    torch_names: tuple[str, ...] = (),
    gemm_epilogue: bool = True,
) -> OpDef:
    return OpDef(
        name=name,
        kind=OpKind.ELEMENTWISE,
        arity=1,
        shape_rule=same_shape,
        numpy_fn=lambda xs, attrs: fn(xs[0]),
        flops_per_elem=lambda attrs: flops,
        regs=lambda attrs: regs,
        code=code,
        fusable_inputs=(0,),
        gemm_epilogue=gemm_epilogue,
        torch_names=torch_names,
        doc=doc,
    )


def _binary(
    name: str,
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    code: str,
    doc: str,
    *,
    shape_rule: Callable[[str, Sequence[Shape], Attrs], Shape] = same_shape,
    flops: float = 1.0,
    fusable: tuple[int, ...] = (0, 1),
    gemm_epilogue: bool | tuple[int, ...] = True,
) -> OpDef:
    """A two-tensor elementwise op; ``code`` is its C expression over ``{0}`` and ``{1}`` (an infix
    operator, or a prelude function such as ``fp_max``)."""
    return OpDef(
        name=name,
        kind=OpKind.ELEMENTWISE,
        arity=2,
        shape_rule=shape_rule,
        numpy_fn=lambda xs, attrs: fn(xs[0], xs[1]),
        flops_per_elem=lambda attrs: flops,
        regs=lambda attrs: 8,
        code=lambda v, attrs: code.format(v[0], v[1]),
        fusable_inputs=fusable,
        gemm_epilogue=gemm_epilogue,
        doc=doc,
    )


def _reduction(name: str, fn: Callable[[np.ndarray], np.ndarray], doc: str) -> OpDef:
    """A reduction over the last dimension, kept as a dimension of 1 (``keepdim=True``). The row kernel
    computes it in a loop over the row and hands it to its consumers as one value per row; an elementwise
    producer runs inside that loop. FLOPs: one per input element."""
    return OpDef(
        name=name,
        kind=OpKind.REDUCTION,
        arity=1,
        shape_rule=_row_shape,
        numpy_fn=lambda xs, attrs: fn(xs[0]),
        regs=lambda attrs: 8,
        flops_rule=lambda out, ins, attrs: float(_elems(ins[0])),
        fusable_inputs=(0,),
        gemm_epilogue=False,  # a GEMM tile's epilogue runs elementwise; a row kernel reads whole rows
        doc=doc,
    )


def _batched(name: str, transpose_b: bool, fn: Callable[[Sequence[np.ndarray], Attrs], np.ndarray], doc: str,
             attrs: tuple[AttrSpec, ...] = ()) -> OpDef:
    """A batched product of attention, a standalone kernel: (G,S,K) times (G,K,N), or (G,T,K) transposed."""
    return OpDef(
        name=name,
        kind=OpKind.STANDALONE,
        arity=2,
        attrs=attrs,
        shape_rule=lambda op, shapes, attrs: _batch_shape(op, shapes, transpose_b),
        numpy_fn=fn,
        flops_rule=lambda out, ins, attrs: 2.0 * _elems(out) * ins[0][-1],
        regs=lambda attrs: 64,
        doc=doc,
    )


def _row_mean(x: np.ndarray) -> np.ndarray:
    return np.sum(x, axis=-1, keepdims=True) / x.dtype.type(x.shape[-1])


def _torch_names(fn: str, functional: bool = False) -> tuple[str, ...]:
    """The canonical names of a one-tensor torch function: ``torch.f``, ``Tensor.f``, the aten op and
    (``functional``) ``torch.nn.functional.f``."""
    names = (f"torch.{fn}", f"torch.Tensor.{fn}", f"torch.ops.aten.{fn}.default")
    return names + ((f"torch.nn.functional.{fn}",) if functional else ())


def _quiet(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """numpy's function with its overflow/invalid warnings off: inf and NaN are the values, as in torch."""

    def call(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return fn(x)

    return call


#: Cast's snippet by target dtype: each backend's prelude defines the rounding functions
_ROUND_C = {"fp32": "({})", "bf16": "fp_round_bf16({})", "fp16": "fp_round_f16({})"}
assert set(_ROUND_C) == set(DTYPE_BYTES)
#: fp_tanh, fp_erf: each backend's prelude (the C one inline rational functions, CUDA's tanhf and erff)
_GELU_TANH_C = "0.5f*{0}*(1.0f+fp_tanh(0.7978845608028654f*({0}+0.044715f*{0}*{0}*{0})))"

OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        OpDef(
            name="In",
            kind=OpKind.INPUT,
            arity=0,
            doc="A graph input or weight, already in memory.",
        ),
        OpDef(
            name="MatMul",
            kind=OpKind.MATMUL,
            arity=2,
            shape_rule=_matmul_shape,
            numpy_fn=lambda xs, attrs: xs[0] @ xs[1],
            regs=lambda attrs: 128,
            doc="2-D matrix product (M,K)@(K,N) with fp32 accumulation.",
        ),
        # a row vector (a bias, a norm's weight) is read by column; only x fuses (the vector is in memory)
        _binary("BiasAdd", np.add, "({0} + {1})", "x + bias, the bias a row vector broadcast over the leading dims.",
                shape_rule=_bias_shape, fusable=(0,)),
        _binary("Add", np.add, "({0} + {1})", "Elementwise sum of two same-shaped tensors (e.g. a residual)."),
        _binary("Sub", np.subtract, "({0} - {1})", "Elementwise difference of two same-shaped tensors."),
        # torch.maximum / torch.minimum: each backend's prelude defines fp_max / fp_min (NaN wins; a tie gives
        # the second operand, as torch and numpy do)
        _binary("Maximum", np.maximum, "fp_max({0}, {1})", "The larger of two same-shaped tensors, elementwise (NaN if either is NaN)."),
        _binary("Minimum", np.minimum, "fp_min({0}, {1})", "The smaller of two same-shaped tensors, elementwise (NaN if either is NaN)."),
        _binary("Mul", np.multiply, "({0} * {1})", "Elementwise product of two same-shaped tensors (e.g. a SwiGLU gate)."),
        # a GEMM result as the divisor is no epilogue: one that underflows a 16-bit store changes the
        # quotient by 4% between the stored and the register form (check-rules found it)
        _binary("Div", _divide, "({0} / {1})", "Elementwise quotient of two same-shaped tensors (IEEE: x/0 is ±inf, 0/0 NaN).",
                flops=4.0, gemm_epilogue=(0,)),
        OpDef(
            name="Affine",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            attrs=(AttrSpec("a", "f64"), AttrSpec("b", "f64")),
            shape_rule=same_shape,
            numpy_fn=lambda xs, attrs: _affine(xs[0], attrs),
            flops_per_elem=lambda attrs: float((attrs["a"] != 1.0) + (attrs["b"] != 0.0)),
            regs=lambda attrs: 4,
            code=_affine_c,
            fusable_inputs=(0,),
            doc="a*x + b with scalar a and b (an identity term, a = 1 or b = 0, is not computed).",
        ),
        _unary(
            "Relu",
            lambda x: np.maximum(x, x.dtype.type(0)),
            1.0,
            4,
            lambda v, attrs: f"fp_relu({v[0]})",  # each backend's prelude: NaN stays NaN, as in torch and numpy
            "max(x, 0).",
        ),
        _unary(
            "GeluTanh",
            _gelu_tanh,
            8.0,
            16,
            lambda v, attrs: _GELU_TANH_C.format(v[0]),
            "GELU, tanh approximation (the form cuBLASLt's GELU epilogue computes).",
        ),
        _unary(
            "GeluErf",
            _gelu_erf,
            8.0,
            16,
            lambda v, attrs: f"0.5f*{v[0]}*(1.0f+fp_erf({v[0]}*0.7071067811865476f))",  # fp_erf: each prelude's
            "GELU, exact erf form. Never rewritten into the tanh form.",
        ),
        _unary(
            "Silu",
            _silu,
            4.0,
            12,
            lambda v, attrs: f"({v[0]}/(1.0f+expf(-{v[0]})))",
            "x * sigmoid(x).",
        ),
        _unary("Neg", lambda x: -x, 1.0, 4, lambda v, attrs: f"(-{v[0]})", "-x (the sign bit flipped, NaN included)."),
        _unary("Exp", _quiet(np.exp), 4.0, 8, lambda v, attrs: f"expf({v[0]})", "e**x.", _torch_names("exp")),
        _unary("Tanh", np.tanh, 4.0, 8, lambda v, attrs: f"fp_tanh({v[0]})", "tanh(x).", _torch_names("tanh", True)),
        _unary(
            "Sigmoid",
            _quiet(lambda x: 1 / (1 + np.exp(-x))),
            4.0,
            8,
            lambda v, attrs: f"(1.0f/(1.0f+expf(-{v[0]})))",
            "1 / (1 + e**-x).",
            _torch_names("sigmoid", True),
        ),
        # Not GEMM epilogues: a product that underflows a 16-bit store (check-rules found fp16 8e-8 -> 6e-8)
        # changes its root by 14% between the stored and the register form, far outside the tolerance.
        _unary("Sqrt", _quiet(np.sqrt), 1.0, 4, lambda v, attrs: f"sqrtf({v[0]})", "sqrt(x); NaN below 0.",
               _torch_names("sqrt"), gemm_epilogue=False),
        _unary("Rsqrt", _quiet(lambda x: 1 / np.sqrt(x)), 2.0, 4, lambda v, attrs: f"(1.0f/sqrtf({v[0]}))",
               "1 / sqrt(x) (correctly rounded sqrt, then a division: not an approximate rsqrt).",
               _torch_names("rsqrt"), gemm_epilogue=False),
        _unary("Square", lambda x: x * x, 1.0, 4, lambda v, attrs: f"({v[0]}*{v[0]})", "x * x.",
               _torch_names("square")),
        # torch's .to(dtype) between float dtypes: the value rounded to the dtype, in registers too (a narrowing
        # cast is the rounding its author asked for); to fp32 it is exact, so it costs nothing once fused
        OpDef(
            name="Cast",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            attrs=(AttrSpec("dtype", "String", choices=tuple(DTYPE_BYTES)),),
            shape_rule=same_shape,
            dtype_rule=lambda attrs: str(attrs["dtype"]),
            numpy_fn=lambda xs, attrs: xs[0] if attrs["dtype"] == "fp32" else round_to(xs[0], str(attrs["dtype"])),
            flops_per_elem=lambda attrs: 0.0 if attrs["dtype"] == "fp32" else 1.0,
            regs=lambda attrs: 0,
            code=lambda v, attrs: _ROUND_C[str(attrs["dtype"])].format(v[0]),
            fusable_inputs=(0,),
            doc="x as another float dtype (torch's x.to(dtype)): rounded to it (to nearest even), exact to fp32.",
        ),
        _reduction("RowSum", lambda x: np.sum(x, axis=-1, keepdims=True), "Sum over the last dimension, kept as 1."),
        _reduction("RowMean", _row_mean, "Mean over the last dimension (the sum divided by its size), kept as 1."),
        _reduction("RowMax", _quiet(lambda x: np.max(x, axis=-1, keepdims=True)),
                   "Largest value over the last dimension, kept as 1 (NaN if the row holds one, as torch.amax)."),
        # x <op> r with r one value per row of x (shape [..., 1]), as torch broadcasts a kept reduction: the
        # consumers of a row statistic (x - mean, e / sum); a GEMM result may be x, not r
        _binary("AddRow", np.add, "({0} + {1})", "x + r, r one value per row of x.", shape_rule=_per_row_shape, gemm_epilogue=(0,)),
        _binary("SubRow", np.subtract, "({0} - {1})", "x - r, r one value per row of x.", shape_rule=_per_row_shape, gemm_epilogue=(0,)),
        _binary("MulRow", np.multiply, "({0} * {1})", "x * r, r one value per row of x.", shape_rule=_per_row_shape, gemm_epilogue=(0,)),
        _binary("DivRow", _divide, "({0} / {1})", "x / r, r one value per row of x (IEEE: x/0 is ±inf, 0/0 NaN).", shape_rule=_per_row_shape, flops=4.0, gemm_epilogue=(0,)),
        _binary("BiasMul", np.multiply, "({0} * {1})", "x * w, w a row vector broadcast over the leading dims (a norm's weight).",
                shape_rule=_bias_shape, fusable=(0,)),
        # rotary position embeddings (RoPE), as LLaMA-style model code writes them: x*cos + rotate_half(x)*sin,
        # cos and sin one (seq, head dim) table repeated over batch and heads
        _binary("TileMul", np.multiply, "({0} * {1})", "x * t, t's shape the trailing dimensions of x's (two or more), "
                "repeated over the leading ones (RoPE's cos and sin over batch and heads).",
                shape_rule=_tile_shape, fusable=(0,), gemm_epilogue=False),
        _binary("TileAdd", np.add, "({0} + {1})", "x + t, t's shape the trailing dimensions of x's (two or more), "
                "repeated over the leading ones.", shape_rule=_tile_shape, fusable=(0,), gemm_epilogue=False),
        # a layout op a kernel reads through index arithmetic: the generators load its input at the other half's
        # column (negated for the first half), so the snippet is the identity on that value and the input is never
        # fused (it is read from memory, like a bias)
        OpDef(
            name="RotateHalf",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            shape_rule=_rotate_half_shape,
            numpy_fn=lambda xs, attrs: _rotate_half(xs[0]),
            flops_per_elem=lambda attrs: 1.0,
            regs=lambda attrs: 4,
            code=lambda v, attrs: f"({v[0]})",
            doc="cat(-x[..., d/2:], x[..., :d/2]) over the last dimension d: RoPE's rotate_half, read by the "
                "kernel that consumes it (no kernel of its own).",
        ),
        # attention, as model code writes it: the heads taken out of a packed projection, softmax(scale * q@kT)
        # @ v from batched products and row ops, the heads merged back; rewrite_rules/attention.egg fuses it
        OpDef(
            name="Heads",
            kind=OpKind.STANDALONE,
            arity=1,
            attrs=(AttrSpec("heads", "i64", minimum=1), AttrSpec("seq", "i64", minimum=1),
                   AttrSpec("offset", "i64", minimum=0), AttrSpec("width", "i64", minimum=1)),
            shape_rule=_heads_shape,
            numpy_fn=lambda xs, attrs: _heads(xs[0], attrs),
            doc="Columns [offset, offset+width) of (batch*seq, C) token rows as (batch*heads, seq, width/heads): "
                "torch's split(-1), view and transpose(1, 2) of q, k or v, copied head-major.",
        ),
        OpDef(
            name="Merge",
            kind=OpKind.STANDALONE,
            arity=1,
            attrs=(AttrSpec("heads", "i64", minimum=1),),
            shape_rule=_merge_shape,
            numpy_fn=lambda xs, attrs: _merge(xs[0], attrs),
            doc="(batch*heads, seq, d) back to (batch*seq, heads*d) token rows: transpose(1, 2) and reshape.",
        ),
        _batched("BatchScores", True, lambda xs, attrs: _batch_scores(xs[0], xs[1], attrs),
                 "q @ k^T per group, (G,S,K) x (G,T,K) -> (G,S,T); causal (1) sets query i's keys after i to -inf.",
                 (AttrSpec("causal", "i64", 0, minimum=0),)),
        _batched("BatchApply", False, lambda xs, attrs: np.matmul(xs[0], xs[1]),
                 "p @ v per group, (G,S,T) x (G,T,N) -> (G,S,N): attention probabilities applied to the values."),
        OpDef(
            name="Attention",
            kind=OpKind.STANDALONE,
            arity=3,
            attrs=(AttrSpec("scale", "f64"), AttrSpec("causal", "i64", 0, minimum=0)),
            shape_rule=_attention_op_shape,
            numpy_fn=lambda xs, attrs: _attention(xs[0], xs[1], xs[2], attrs),
            flops_rule=lambda out, ins, attrs: 2.0 * ins[1][1] * _elems(out[:-1]) * (ins[0][-1] + out[-1]),
            regs=lambda attrs: 96,
            doc="softmax(scale * q@k^T, causal-masked) @ v in one kernel with an online softmax: the [S, T] "
                "scores are never stored.",
        ),
        # an attention mask, as torch's attn_mask adds it to the scaled scores: a padding mask (batch, 1, 1, T)
        # repeated over the heads (GroupRepeat, a copy of one row per group), then added to every query's row
        OpDef(
            name="GroupRepeat",
            kind=OpKind.STANDALONE,
            arity=1,
            attrs=(AttrSpec("heads", "i64", minimum=1), AttrSpec("rows", "i64", minimum=1)),
            shape_rule=_group_repeat_shape,
            numpy_fn=lambda xs, attrs: _group_repeat(xs[0], attrs),
            doc="(batch*rows, T) as (batch*heads, rows, T): each batch's rows repeated for its heads (a mask "
                "broadcast over heads, copied group-major); or groups (G, rows, T) as (G*heads, rows, T), each "
                "repeated (grouped-query attention's keys and values for their query heads).",
        ),
        _binary("MaskAdd", np.add, "({0} + {1})", "x + m, x scores (G, S, T) and m one row of keys per group "
                "(G, 1, T), added to every query's row (an attention mask).", shape_rule=_mask_shape, fusable=(0,),
                gemm_epilogue=False),
        OpDef(
            name="MaskedAttention",
            kind=OpKind.STANDALONE,
            arity=4,
            attrs=(AttrSpec("scale", "f64"),),
            shape_rule=_attention_op_shape,
            numpy_fn=lambda xs, attrs: _attention(xs[0], xs[1], xs[2], {**attrs, "causal": 0}, xs[3]),
            flops_rule=lambda out, ins, attrs: 2.0 * ins[1][1] * _elems(out[:-1]) * (ins[0][-1] + out[-1]),
            regs=lambda attrs: 96,
            doc="softmax(scale * q@k^T + m) @ v in one kernel with an online softmax, m one row of keys per "
                "group (G, 1, T): the [S, T] scores are never stored.",
        ),
        OpDef(
            name="Stage",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            attrs=(
                AttrSpec("flops", "i64", 1, minimum=0),
                AttrSpec("regs", "i64", 8, minimum=0),
                AttrSpec("temps", "i64", 0, minimum=0),
            ),
            shape_rule=same_shape,
            numpy_fn=lambda xs, attrs: xs[0],
            flops_per_elem=lambda attrs: float(attrs["flops"]),
            regs=lambda attrs: int(attrs["regs"]),
            code=lambda v, attrs: f"({v[0]})",
            fusable_inputs=(0,),
            gemm_epilogue=False,  # the seed's synthetic stages model elementwise chains, never GEMM epilogues
            probe_temps=lambda attrs: int(attrs["temps"]),
            doc=(
                "Synthetic stage: the identity on values, with FLOPs per element and live "
                "registers given as attributes (the seed's register-pressure examples). "
                "`temps` > 0 asks code generators for that many extra live temporaries."
            ),
        ),
    ]
}



def register_op(op: OpDef) -> OpDef:
    """Add an op kind to the table (the one step adding an op takes: rules, codegen and import follow)."""
    if op.name in OPS:
        raise OpError(f"op {op.name!r} is already in the op table")
    OPS[op.name] = op
    return op


def op_def(name: str) -> OpDef:
    """Look up an op kind; unknown names are an error naming the op."""
    try:
        return OPS[name]
    except KeyError:
        raise OpError(
            f"unknown op {name!r}; known ops: {', '.join(sorted(OPS))} "
            "(foreign ops enter only as a registered Opaque implementation)"
        ) from None


# ---------------------------------------------------------------- cuBLASLt
# The cuBLASLt constructor of the rule language is
#   (CublasLt a b bias "EPILOGUE")
# with bias = (NoBias) for the bias-less epilogues.  Its meaning is the op tree
# below, evaluated in fp32 registers and stored once.  GELU is the tanh form.

CUBLASLT_EPILOGUES: dict[str, tuple[str, ...]] = {
    # epilogue: elementwise ops applied to the GEMM result, innermost first
    "DEFAULT": (),
    "BIAS": ("BiasAdd",),
    "RELU": ("Relu",),
    "RELU_BIAS": ("BiasAdd", "Relu"),
    "GELU": ("GeluTanh",),
    "GELU_BIAS": ("BiasAdd", "GeluTanh"),
}


def epilogue_has_bias(epilogue: str) -> bool:
    return "BiasAdd" in CUBLASLT_EPILOGUES[epilogue]

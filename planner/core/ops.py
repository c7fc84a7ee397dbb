"""The op table: every op kind described once.

Each :class:`OpDef` holds, for one op kind, everything the rest of the planner
needs to know about it: its egglog constructor signature, its shape rule
(:mod:`planner.core.shapes`), its numpy semantics (:mod:`planner.core.semantics`),
its ledger rules (FLOPs and live registers when fused), the C/CUDA code snippet
that the generated kernels use and, for a reduction, its start value and combine
(:class:`Reduction`).  Adding an op means adding one entry to :data:`OPS` (or
calling :func:`register_op`); docs/architecture.md lists what follows from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from planner.core import semantics as sem
from planner.core.dtypes import DTYPES, round_to
from planner.core.kinds import OpKind
from planner.core.opdef import AttrSpec, CodeFn, OpDef, OpError, Reduction, example_operands, float_literal
from planner.core.shapes import (
    WINDOW,
    Attrs,
    Shape,
    ShapeRule,
    attention_shape,
    batched_shape,
    bias_shape,
    biased_attention_shape,
    channels_first_shape,
    channels_last_shape,
    columns_shape,
    depthwise_shape,
    embedding_shape,
    group_repeat_shape,
    heads_shape,
    im2col_shape,
    mask_shape,
    matmul_shape,
    merge_shape,
    per_image_shape,
    per_row_shape,
    pool_shape,
    regroup_shape,
    rotate_half_shape,
    row_shape,
    same_shape,
    spatial_mean_shape,
    tile_shape,
)

__all__ = ["CUBLASLT_EPILOGUES", "GATHERS", "LAYOUT_COPIES", "OPS", "POOLS", "WINDOWED_PRODUCTS", "AttrSpec", "OpDef", "OpError", "Reduction", "epilogue_has_bias",
           "example_operands", "float_literal", "op_def", "register_op", "same_shape"]


def _affine_c(v: Sequence[str], attrs: Attrs) -> str:
    """``a*x + b`` without its identity terms, as :func:`semantics.affine` computes it: ``x*a`` (torch's scalar
    multiply) keeps a zero product's sign, and the compiler can contract ``x*a`` with a following
    ``+ b`` into one FMA, which ``x*a + 0.0f`` would prevent."""
    a, b = float(attrs["a"]), float(attrs["b"])
    y = v[0] if a == 1.0 else f"{float_literal(a)}*{v[0]}"
    return f"({y})" if b == 0.0 else f"({y} + {float_literal(b)})"


def _unary(
    name: str,
    fn: Callable[[np.ndarray], np.ndarray],
    flops: float,
    regs: int,
    code: CodeFn,
    doc: str,
    torch_names: tuple[str, ...] = (),
    gemm_epilogue: bool = True,
    positive: bool = False,
    label: str = "",
) -> OpDef:
    return OpDef(
        name=name,
        kind=OpKind.ELEMENTWISE,
        arity=1,
        positive_inputs=(0,) if positive else (),
        shape_rule=same_shape,
        numpy_fn=lambda xs, attrs: fn(xs[0]),
        flops_per_elem=lambda attrs: flops,
        regs=lambda attrs: regs,
        code=code,
        fusable_inputs=(0,),
        gemm_epilogue=gemm_epilogue,
        torch_names=torch_names,
        doc=doc,
        label=label,
    )


def _binary(
    name: str,
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
    code: str,
    doc: str,
    *,
    shape_rule: ShapeRule = same_shape,
    flops: float = 1.0,
    fusable: tuple[int, ...] = (0, 1),
    gemm_epilogue: bool | tuple[int, ...] = True,
    positive: tuple[int, ...] = (),
    label: str = "",
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
        positive_inputs=positive,
        doc=doc,
        label=label,
    )


def reduction_op(name: str, fn: Callable[[np.ndarray], np.ndarray], reduction: Reduction, doc: str) -> OpDef:
    """A reduction over the last dimension, kept as a dimension of 1 (``keepdim=True``): ``fn`` its numpy
    semantics, ``reduction`` how a row kernel computes it. The row kernel computes it in a loop over the row and
    hands it to its consumers as one value per row; an elementwise producer runs inside that loop. FLOPs: one
    per input element."""
    return OpDef(
        name=name,
        kind=OpKind.REDUCTION,
        arity=1,
        shape_rule=row_shape,
        numpy_fn=lambda xs, attrs: fn(xs[0]),
        regs=lambda attrs: 8,
        flops_rule=lambda out, ins, attrs: float(math.prod(ins[0])),
        fusable_inputs=(0,),
        gemm_epilogue=False,  # a GEMM tile's epilogue runs elementwise; a row kernel reads whole rows
        reduction=reduction,
        doc=doc,
    )


def _batched(name: str, transpose_b: bool, fn: Callable[[Sequence[np.ndarray], Attrs], np.ndarray], doc: str,
             attrs: tuple[AttrSpec, ...] = (), label: str = "bmm") -> OpDef:
    """A batched product of attention, a standalone kernel: (G,S,K) times (G,K,N), or (G,T,K) transposed."""
    return OpDef(
        name=name,
        kind=OpKind.STANDALONE,
        arity=2,
        attrs=attrs,
        shape_rule=batched_shape(transpose_b),
        numpy_fn=fn,
        flops_rule=lambda out, ins, attrs: 2.0 * math.prod(out) * ins[0][-1],
        regs=lambda attrs: 64,
        doc=doc,
        label=label,
    )


def _standalone1(name: str, label: str, attrs: tuple[AttrSpec, ...], shape_rule: ShapeRule,
                 fn: Callable[[np.ndarray, Attrs], np.ndarray], doc: str) -> OpDef:
    """A standalone op of one input computed by ``fn(x, attrs)`` (a layout copy, a window over an image)."""
    return OpDef(name=name, label=label, kind=OpKind.STANDALONE, arity=1, attrs=attrs, shape_rule=shape_rule,
                 numpy_fn=lambda xs, a: fn(xs[0], a), doc=doc)


def _attention_flops(out: Shape, ins: Sequence[Shape], attrs: Attrs) -> float:
    """Both products of attention, (G,S,T) scores of K and (G,S,N) outputs of T: 2*G*S*T*(K + N)."""
    return 2.0 * ins[1][1] * math.prod(out[:-1]) * (ins[0][-1] + out[-1])


def _added_attention(name: str, shape_rule: ShapeRule, doc: str) -> OpDef:
    """Attention with a fourth input added to the scaled scores before the softmax (a mask, a bias), not causal."""
    return OpDef(name=name, label="attention", kind=OpKind.STANDALONE, arity=4, attrs=(AttrSpec("scale", "f64"),),
                 shape_rule=shape_rule, regs=lambda attrs: 96, flops_rule=_attention_flops, doc=doc,
                 numpy_fn=lambda xs, attrs: sem.attention(xs[0], xs[1], xs[2], {**attrs, "causal": 0}, xs[3]))


#: the window of an image op (core.shapes.WINDOW): kernel, stride and dilation at least 1, padding at least 0
_WINDOW_ATTRS = tuple(AttrSpec(a, "i64", minimum=0 if a in ("ph", "pw") else 1) for a in WINDOW)


def _torch_names(fn: str, functional: bool = False) -> tuple[str, ...]:
    """The canonical names of a one-tensor torch function: ``torch.f``, ``Tensor.f``, the aten op and
    (``functional``) ``torch.nn.functional.f``."""
    names = (f"torch.{fn}", f"torch.Tensor.{fn}", f"torch.ops.aten.{fn}.default")
    return names + ((f"torch.nn.functional.{fn}",) if functional else ())


#: which bounds a Clamp applies: both, only the lower ('min', torch's clamp_min) or only the upper ('max')
CLAMP_SIDES = ("both", "min", "max")
#: min(max(x + 3, 0), 6), the gate of hardswish and hardsigmoid
_HARD_GATE_C = "fp_min(fp_max({0} + 3.0f, 0.0f), 6.0f)"


def _clamp_c(v: Sequence[str], attrs: Attrs) -> str:
    x = v[0] if attrs["sides"] == "max" else f"fp_max({v[0]}, {float_literal(attrs['lo'])})"
    return x if attrs["sides"] == "min" else f"fp_min({x}, {float_literal(attrs['hi'])})"


#: fp_tanh, fp_erf, fp_exp: each backend's prelude (the C one's rational functions and Cephes' exp; CUDA's tanhf, erff
#: and expf)
_GELU_TANH_C = "0.5f*{0}*(1.0f+fp_tanh(0.7978845608028654f*({0}+0.044715f*{0}*{0}*{0})))"
#: the sum's and the maximum's way through a row (RowMean divides the sum by the row's length)
_SUM = Reduction(0.0, "({a} + {b})", vector="({a} + {b})")
_MAX = Reduction(-math.inf, "fp_max({a}, {b})", vector="fp_va_max({a}, {b})", quiet="fp_va_qmax({a}, {b})")

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
            shape_rule=matmul_shape,
            numpy_fn=lambda xs, attrs: xs[0] @ xs[1],
            regs=lambda attrs: 128,
            label="gemm",
            doc="2-D matrix product (M,K)@(K,N) with fp32 accumulation.",
        ),
        # a row vector (a bias, a norm's weight) is read by column; only x fuses (the vector is in memory)
        _binary("BiasAdd", np.add, "({0} + {1})", "x + bias, the bias a row vector broadcast over the leading dims.",
                shape_rule=bias_shape, fusable=(0,), label="bias"),
        _binary("Add", np.add, "({0} + {1})", "Elementwise sum of two same-shaped tensors (e.g. a residual)."),
        _binary("Sub", np.subtract, "({0} - {1})", "Elementwise difference of two same-shaped tensors."),
        # torch.maximum / torch.minimum: each backend's prelude defines fp_max / fp_min (NaN wins; a tie gives
        # the second operand, as torch and numpy do)
        _binary("Maximum", np.maximum, "fp_max({0}, {1})", "The larger of two same-shaped tensors, elementwise (NaN if either is NaN).", label="max"),
        _binary("Minimum", np.minimum, "fp_min({0}, {1})", "The smaller of two same-shaped tensors, elementwise (NaN if either is NaN).", label="min"),
        _binary("Mul", np.multiply, "({0} * {1})", "Elementwise product of two same-shaped tensors (e.g. a SwiGLU gate)."),
        # a GEMM result as the divisor is no epilogue: one that underflows a 16-bit store changes the
        # quotient by 4% between the stored and the register form (check-rules found it)
        _binary("Div", sem.divide, "({0} / {1})", "Elementwise quotient of two same-shaped tensors (IEEE: x/0 is ±inf, 0/0 NaN).",
                flops=4.0, gemm_epilogue=(0,), positive=(1,)),
        OpDef(
            name="Affine",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            attrs=(AttrSpec("a", "f64", examples=(0.5, 1.5, -2.0)), AttrSpec("b", "f64", examples=(0.0, 0.25))),
            shape_rule=same_shape,
            numpy_fn=lambda xs, attrs: sem.affine(xs[0], attrs),
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
            sem.gelu_tanh,
            8.0,
            16,
            lambda v, attrs: _GELU_TANH_C.format(v[0]),
            "GELU, tanh approximation (the form cuBLASLt's GELU epilogue computes).",
            label="gelu",
        ),
        _unary(
            "GeluErf",
            sem.gelu_erf,
            8.0,
            16,
            lambda v, attrs: f"0.5f*{v[0]}*(1.0f+fp_erf({v[0]}*0.7071067811865476f))",  # fp_erf: each prelude's
            "GELU, exact erf form. Never rewritten into the tanh form.",
            label="gelu",
        ),
        _unary(
            "Silu",
            sem.silu,
            4.0,
            12,
            lambda v, attrs: f"({v[0]}/(1.0f+fp_exp(-{v[0]})))",
            "x * sigmoid(x).",
        ),
        _unary("Neg", lambda x: -x, 1.0, 4, lambda v, attrs: f"(-{v[0]})", "-x (the sign bit flipped, NaN included)."),
        _unary("Exp", sem.quiet(np.exp), 4.0, 8, lambda v, attrs: f"fp_exp({v[0]})", "e**x.", _torch_names("exp")),
        _unary("Tanh", np.tanh, 4.0, 8, lambda v, attrs: f"fp_tanh({v[0]})", "tanh(x).", _torch_names("tanh", True)),
        _unary(
            "Sigmoid",
            sem.quiet(lambda x: 1 / (1 + np.exp(-x))),
            4.0,
            8,
            lambda v, attrs: f"(1.0f/(1.0f+fp_exp(-{v[0]})))",
            "1 / (1 + e**-x).",
            _torch_names("sigmoid", True),
        ),
        # Not GEMM epilogues: a product that underflows a 16-bit store (check-rules found fp16 8e-8 -> 6e-8)
        # changes its root by 14% between the stored and the register form, far outside the tolerance.
        _unary("Sqrt", sem.quiet(np.sqrt), 1.0, 4, lambda v, attrs: f"sqrtf({v[0]})", "sqrt(x); NaN below 0.",
               _torch_names("sqrt"), gemm_epilogue=False, positive=True),
        _unary("Rsqrt", sem.quiet(lambda x: 1 / np.sqrt(x)), 2.0, 4, lambda v, attrs: f"(1.0f/sqrtf({v[0]}))",
               "1 / sqrt(x) (correctly rounded sqrt, then a division: not an approximate rsqrt).",
               _torch_names("rsqrt"), gemm_epilogue=False, positive=True),
        _unary("Square", lambda x: x * x, 1.0, 4, lambda v, attrs: f"({v[0]}*{v[0]})", "x * x.",
               _torch_names("square")),
        # the piecewise-linear activations of vision models (MobileNet, YOLO): fp_max / fp_min keep NaN, as torch
        OpDef(
            name="Clamp",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            attrs=(AttrSpec("lo", "f64", examples=(0.0, -1.0)), AttrSpec("hi", "f64", examples=(6.0, 1.0)),
                   AttrSpec("sides", "String", "both", choices=CLAMP_SIDES)),
            shape_rule=same_shape,
            numpy_fn=lambda xs, attrs: sem.clamp(xs[0], attrs),
            flops_per_elem=lambda attrs: 2.0 if attrs["sides"] == "both" else 1.0,
            regs=lambda attrs: 4,
            code=_clamp_c,
            fusable_inputs=(0,),
            doc="x limited to [lo, hi] (torch.clamp, hardtanh, relu6); sides 'min' or 'max' applies one bound only.",
            label="clamp",
        ),
        OpDef(
            name="LeakyRelu",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            attrs=(AttrSpec("slope", "f64", 0.01, examples=(0.01, 0.2)),),
            shape_rule=same_shape,
            numpy_fn=lambda xs, attrs: sem.leaky_relu(xs[0], attrs),
            flops_per_elem=lambda attrs: 3.0,
            regs=lambda attrs: 6,
            # branch-free (gcc's -ftrapping-math keeps a select around a product scalar): max(x,0) + slope*min(x,0)
            code=lambda v, attrs: f"(fp_relu({v[0]}) + {float_literal(attrs['slope'])}*fp_min({v[0]}, 0.0f))",
            fusable_inputs=(0,),
            doc="x where x > 0, else slope * x (NaN stays NaN).",
            label="leaky_relu",
        ),
        _unary("Hardswish", sem.hardswish, 5.0, 6, lambda v, attrs: f"({v[0]}*{_HARD_GATE_C.format(v[0])}/6.0f)",
               "x * min(max(x + 3, 0), 6) / 6.", label="hardswish"),
        _unary("Hardsigmoid", sem.hardsigmoid, 4.0, 4, lambda v, attrs: f"({_HARD_GATE_C.format(v[0])}/6.0f)",
               "min(max(x + 3, 0), 6) / 6.", label="hardsigmoid"),
        # torch's .to(dtype) between float dtypes: the value rounded to the dtype, in registers too (a narrowing
        # cast is the rounding its author asked for); to fp32 it is exact, so it costs nothing once fused
        OpDef(
            name="Cast",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            attrs=(AttrSpec("dtype", "String", choices=tuple(DTYPES)),),
            shape_rule=same_shape,
            dtype_rule=lambda ins, attrs: str(attrs["dtype"]),
            numpy_fn=lambda xs, attrs: xs[0] if attrs["dtype"] == "fp32" else round_to(xs[0], str(attrs["dtype"])),
            flops_per_elem=lambda attrs: 0.0 if attrs["dtype"] == "fp32" else 1.0,
            regs=lambda attrs: 0,
            code=lambda v, attrs: DTYPES[str(attrs["dtype"])].round_c.format(v[0]),
            fusable_inputs=(0,),
            doc="x as another float dtype (torch's x.to(dtype)): rounded to it (to nearest even), exact to fp32.",
        ),
        reduction_op("RowSum", lambda x: np.sum(x, axis=-1, keepdims=True), _SUM,
                     "Sum over the last dimension, kept as 1."),
        reduction_op("RowMean", sem.row_mean, Reduction(0.0, _SUM.combine, "({acc} / {width}.0f)", _SUM.vector),
                     "Mean over the last dimension (the sum divided by its size), kept as 1."),
        reduction_op("RowMax", sem.quiet(lambda x: np.max(x, axis=-1, keepdims=True)), _MAX,
                     "Largest value over the last dimension, kept as 1 (NaN if the row holds one, as torch.amax)."),
        # x <op> r with r one value per row of x (shape [..., 1]), as torch broadcasts a kept reduction: the
        # consumers of a row statistic (x - mean, e / sum); a GEMM result may be x, not r
        _binary("AddRow", np.add, "({0} + {1})", "x + r, r one value per row of x.", shape_rule=per_row_shape, gemm_epilogue=(0,),
                label="add"),
        _binary("SubRow", np.subtract, "({0} - {1})", "x - r, r one value per row of x.", shape_rule=per_row_shape, gemm_epilogue=(0,),
                label="sub"),
        _binary("MulRow", np.multiply, "({0} * {1})", "x * r, r one value per row of x.", shape_rule=per_row_shape, gemm_epilogue=(0,),
                label="mul"),
        _binary("DivRow", sem.divide, "({0} / {1})", "x / r, r one value per row of x (IEEE: x/0 is ±inf, 0/0 NaN).", shape_rule=per_row_shape, flops=4.0, gemm_epilogue=(0,),
                positive=(1,), label="div"),
        _binary("BiasMul", np.multiply, "({0} * {1})", "x * w, w a row vector broadcast over the leading dims (a norm's weight).",
                shape_rule=bias_shape, fusable=(0,), label="scale"),
        # squeeze-and-excitation (MobileNetV3, EfficientNet): channel weights per image over its pixels' rows; the
        # weights are read from memory (no GEMM epilogue: the weights' row is r / pixels, not a GEMM tile's)
        _binary("PixelMul", sem.per_image(np.multiply), "({0} * {1})",
                "x * s, x channels-last rows (N*pixels, C) and s one row per image (N, C), each image's row over its "
                "pixels (torch's x * s of (N, C, H, W) and (N, C, 1, 1)).",
                shape_rule=per_image_shape, fusable=(0,), gemm_epilogue=False, label="scale"),
        # rotary position embeddings (RoPE), as LLaMA-style model code writes them: x*cos + rotate_half(x)*sin,
        # cos and sin one (seq, head dim) table repeated over batch and heads
        _binary("TileMul", np.multiply, "({0} * {1})", "x * t, t's shape the trailing dimensions of x's (two or more), "
                "repeated over the leading ones (RoPE's cos and sin over batch and heads).",
                shape_rule=tile_shape, fusable=(0,), gemm_epilogue=False, label="mul"),
        _binary("TileAdd", np.add, "({0} + {1})", "x + t, t's shape the trailing dimensions of x's (two or more), "
                "repeated over the leading ones.", shape_rule=tile_shape, fusable=(0,), gemm_epilogue=False,
                label="add"),
        # a layout op a kernel reads through index arithmetic: the generators load its input at the other half's
        # column (negated for the first half), so the snippet is the identity on that value and the input is never
        # fused (it is read from memory, like a bias)
        OpDef(
            name="RotateHalf",
            label="rotate",
            kind=OpKind.ELEMENTWISE,
            arity=1,
            shape_rule=rotate_half_shape,
            numpy_fn=lambda xs, attrs: sem.rotate_half(xs[0]),
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
            shape_rule=heads_shape,
            numpy_fn=lambda xs, attrs: sem.heads(xs[0], attrs),
            doc="Columns [offset, offset+width) of (batch*seq, C) token rows as (batch*heads, seq, width/heads): "
                "torch's split(-1), view and transpose(1, 2) of q, k or v, copied head-major.",
        ),
        # token ids in: the ids are carried as fp32 (exact below 2**24, which binding checks), the rows copied
        # as the table stores them; an id that is no row of the table is an error, as in torch
        OpDef(
            name="Embedding",
            label="embedding",
            kind=OpKind.STANDALONE,
            arity=2,
            shape_rule=embedding_shape,
            dtype_rule=lambda ins, attrs: ins[1],
            numpy_fn=lambda xs, attrs: sem.embedding(xs[0], xs[1]),
            flops_rule=lambda out, ins, attrs: 0.0,
            gathered=(1,),
            doc="table[ids]: one row of the (rows, d) table per id, ids of any shape flattened to the result's "
                "rows (torch's embedding); an id that is not a row of the table is an error.",
        ),
        # a packed projection taken apart: Phi-3's gate_up_proj(x).chunk(2, -1), a split of fused q/k/v columns
        # that no attention reads head-major
        _standalone1("Columns", "columns", (AttrSpec("offset", "i64", minimum=0), AttrSpec("width", "i64", minimum=1)),
                     columns_shape, sem.columns,
                     "Columns [offset, offset+width) of the last dimension, copied: torch's chunk, split or "
                     "x[..., a:b] of a packed projection's output."),
        # a head's rows: Qwen3 normalises q and k per head on view(b, s, heads, d), before the transpose
        _standalone1("Regroup", "regroup", (AttrSpec("width", "i64", minimum=1),), regroup_shape, sem.regroup,
                     "The same elements in order as rows of ``width`` (copied): torch's view of (batch, seq, C) as "
                     "(batch, seq, heads, C / heads), and back."),
        _standalone1("ChannelsLast", "to-nhwc", (AttrSpec("channels", "i64", minimum=1), AttrSpec("pixels", "i64", minimum=1)),
                     channels_last_shape, sem.channels_last,
                     "Images (N, C, pixels) in torch's order, stored flat, as (N*pixels, C) channels-last rows (a copy)."),
        _standalone1("ChannelsFirst", "to-nchw", (AttrSpec("pixels", "i64", minimum=1), AttrSpec("width", "i64", minimum=1)),
                     channels_first_shape, sem.channels_first,
                     "(N*pixels, C) channels-last rows back in torch's (N, C, pixels) order, stored as rows of the "
                     "image's width (a copy)."),
        _standalone1("Im2col", "im2col", _WINDOW_ATTRS, im2col_shape, sem.im2col,
                     "Each output pixel's window (kh x kw taps, stride, padding, dilation) of channels-last rows "
                     "(N*height*width, C), side by side: (N*out pixels, kh*kw*C), 0 in the padding. Times the weight "
                     "as (kh*kw*C, O) it is torch's conv2d (conv1d: height 1)."),
        # MobileNet's and ConvNeXt's depthwise convolutions (groups = channels): no GEMM, each channel its own taps
        OpDef(
            name="DepthwiseConv",
            label="depthwise",
            kind=OpKind.STANDALONE,
            arity=2,
            attrs=_WINDOW_ATTRS,
            shape_rule=depthwise_shape,
            numpy_fn=lambda xs, attrs: sem.depthwise_conv(xs[0], xs[1], attrs),
            flops_rule=lambda out, ins, attrs: 2.0 * math.prod(out) * int(attrs["kh"]) * int(attrs["kw"]),
            doc="Each channel of channels-last rows (N*height*width, C) convolved with its own kh x kw taps, a "
                "weight of (kh*kw, C): (N*out pixels, C), 0 in the padding (torch's conv2d with groups = channels, "
                "conv1d: height 1).",
        ),
        _standalone1("AvgPool", "avgpool2d", (*_WINDOW_ATTRS, AttrSpec("include_pad", "i64", 1, minimum=0),
                                              AttrSpec("divisor", "i64", 0, minimum=0)), pool_shape, sem.avg_pool,
                     "The mean of each window of channels-last rows, 0 in the padding, divided by divisor where it is "
                     "not 0, else by the window's size (include_pad 1) or its pixels inside the image (0): torch's "
                     "avg_pool2d (count_include_pad, divisor_override; no ceil mode)."),
        _standalone1("MaxPool", "maxpool", _WINDOW_ATTRS, pool_shape, sem.max_pool,
                     "The largest value of each window of channels-last rows (torch's max_pool2d; the padding is "
                     "-inf, no ceil mode)."),
        _standalone1("SpatialMean", "avgpool", (AttrSpec("pixels", "i64", minimum=1),), spatial_mean_shape,
                     sem.spatial_mean,
                     "The mean over each image's pixels of channels-last rows (N*pixels, C): (N, C), torch's "
                     "adaptive_avg_pool2d to 1x1 (and x.mean((2, 3)))."),
        OpDef(
            name="Merge",
            kind=OpKind.STANDALONE,
            arity=1,
            attrs=(AttrSpec("heads", "i64", minimum=1),),
            shape_rule=merge_shape,
            numpy_fn=lambda xs, attrs: sem.merge(xs[0], attrs),
            doc="(batch*heads, seq, d) back to (batch*seq, heads*d) token rows: transpose(1, 2) and reshape.",
        ),
        _batched("BatchScores", True, lambda xs, attrs: sem.batch_scores(xs[0], xs[1], attrs),
                 "q @ k^T per group, (G,S,K) x (G,T,K) -> (G,S,T); causal (1) sets query i's keys after i to -inf.",
                 (AttrSpec("causal", "i64", 0, minimum=0),)),
        _batched("BatchApply", False, lambda xs, attrs: np.matmul(xs[0], xs[1]),
                 "p @ v per group, (G,S,T) x (G,T,N) -> (G,S,N): attention probabilities applied to the values."),
        OpDef(
            name="Attention",
            kind=OpKind.STANDALONE,
            arity=3,
            attrs=(AttrSpec("scale", "f64"), AttrSpec("causal", "i64", 0, minimum=0)),
            shape_rule=attention_shape,
            numpy_fn=lambda xs, attrs: sem.attention(xs[0], xs[1], xs[2], attrs),
            flops_rule=_attention_flops,
            regs=lambda attrs: 96,
            doc="softmax(scale * q@k^T, causal-masked) @ v in one kernel with an online softmax: the [S, T] "
                "scores are never stored.",
        ),
        # an attention mask, as torch's attn_mask adds it to the scaled scores: a padding mask (batch, 1, 1, T)
        # repeated over the heads (GroupRepeat, a copy of one row per group), then added to every query's row
        OpDef(
            name="GroupRepeat",
            label="repeat",
            kind=OpKind.STANDALONE,
            arity=1,
            attrs=(AttrSpec("heads", "i64", minimum=1), AttrSpec("rows", "i64", minimum=1)),
            shape_rule=group_repeat_shape,
            numpy_fn=lambda xs, attrs: sem.group_repeat(xs[0], attrs),
            doc="(batch*rows, T) as (batch*heads, rows, T): each batch's rows repeated for its heads (a mask "
                "broadcast over heads, copied group-major); or groups (G, rows, T) as (G*heads, rows, T), each "
                "repeated (grouped-query attention's keys and values for their query heads).",
        ),
        _binary("MaskAdd", np.add, "({0} + {1})", "x + m, x scores (G, S, T) and m one row of keys per group "
                "(G, 1, T), added to every query's row (an attention mask).", shape_rule=mask_shape, fusable=(0,),
                gemm_epilogue=False, label="mask"),
        _added_attention("MaskedAttention", attention_shape,
                         "softmax(scale * q@k^T + m) @ v in one kernel with an online softmax, m one row of keys per "
                         "group (G, 1, T): the [S, T] scores are never stored."),
        _added_attention("BiasedAttention", biased_attention_shape,
                         "softmax(scale * q@k^T + b) @ v in one kernel with an online softmax, b a row of keys per "
                         "query (G, S, T) (T5's relative position bias): the [S, T] scores are never stored."),
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


#: standalone ops that copy their input's bits into another layout (no arithmetic: any dtype)
LAYOUT_COPIES = frozenset({"Heads", "Merge", "GroupRepeat", "Columns", "Regroup", "ChannelsLast", "ChannelsFirst",
                           "Im2col"})
#: standalone ops that reduce windows of channels-last images
POOLS = frozenset({"MaxPool", "AvgPool", "SpatialMean"})
#: the standalone ops that slide a window over channels-last rows and read a weight
WINDOWED_PRODUCTS = frozenset({"DepthwiseConv"})
#: standalone ops that gather rows of their second input at the ids their first holds
GATHERS = frozenset(name for name, d in OPS.items() if d.gathered)


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

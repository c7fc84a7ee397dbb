"""Built-in example graphs: the seeds' workloads and stacks of them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from planner.core.errors import OpError
from planner.core.graph import Graph, GraphBuilder
from planner.core.kinds import OpKind
from planner.core.ops import OPS, OpDef, example_operands, op_def
from planner.core.shapes import Shape


def mlp_epilogue(m: int = 4096, n: int = 4096, k: int = 4096, dtype: str = "fp16", gelu: str = "tanh") -> Graph:
    """Seed 000's chain: GEMM -> +bias -> GELU -> +residual."""
    if gelu not in ("tanh", "erf"):
        raise ValueError(f"--gelu must be 'tanh' or 'erf', got {gelu!r}")
    b = GraphBuilder(f"mlp-epilogue-{m}x{n}x{k}-{dtype}-{gelu}")
    b.input("x", (m, k), dtype)
    b.input("w", (k, n), dtype)
    b.input("b", (n,), dtype)
    b.input("r", (m, n), dtype)
    b.op("mm", "MatMul", ["x", "w"])
    b.op("bias", "BiasAdd", ["mm", "b"])
    b.op("gelu", "GeluTanh" if gelu == "tanh" else "GeluErf", ["bias"])
    b.op("res", "Add", ["gelu", "r"])
    return b.build(["res"])


def heavy(n: int = 2**26, dtype: str = "fp16") -> Graph:
    """Seed 000's "fusion loses" pair: 200 + 100 live registers spill when fused."""
    b = GraphBuilder(f"heavy-{n}-{dtype}")
    b.input("x", (n,), dtype)
    b.op("a", "Stage", ["x"], {"flops": 1, "regs": 200})
    b.op("b", "Stage", ["a"], {"flops": 1, "regs": 100})
    return b.build(["b"])


def ew_chain(k: int = 4, n: int = 2**24, dtype: str = "fp32", fat_temps: int = 0) -> Graph:
    """Seed 001's chain: stage s is y = a_s*y + b_s, then ReLU on even s.

    ``fat_temps`` > 0 appends the C-05 register-pressure probe: a Stage that
    keeps that many live temporaries (identity on values).
    """
    if k < 1:
        raise ValueError(f"--k must be at least 1, got {k}")
    b = GraphBuilder(f"ew-chain-k{k}-{n}-{dtype}" + (f"-fat{fat_temps}" if fat_temps else ""))
    y = b.input("x", (n,), dtype)
    for s in range(k):
        y = b.op(f"affine{s}", "Affine", [y], {"a": 1 + 0.01 * (s + 1), "b": 0.001 * (s + 1)})
        if s % 2 == 0:
            y = b.op(f"relu{s}", "Relu", [y])
    if fat_temps:
        y = b.op("fat", "Stage", [y], {"flops": 2 * fat_temps, "regs": 2 * fat_temps, "temps": fat_temps})
    return b.build([y])


def layer_norm_ops(b: GraphBuilder, x: str, width: int, dtype: str, prefix: str = "") -> str:
    """``LayerNorm(x)`` over the last dimension in the op table's primitives: the row statistics, the per-row
    broadcasts, the weight ``<prefix>w`` and the bias ``<prefix>bias``; the result is ``<prefix>out``."""
    b.input(f"{prefix}w", (width,), dtype)
    b.input(f"{prefix}bias", (width,), dtype)
    mean = b.op(f"{prefix}mean", "RowMean", [x])
    centred = b.op(f"{prefix}centred", "SubRow", [x, mean])
    var = b.op(f"{prefix}var", "RowMean", [b.op(f"{prefix}square", "Square", [centred])])
    rstd = b.op(f"{prefix}rstd", "Rsqrt", [b.op(f"{prefix}var_eps", "Affine", [var], {"a": 1.0, "b": 1e-5})])
    scaled = b.op(f"{prefix}scaled", "BiasMul", [b.op(f"{prefix}normed", "MulRow", [centred, rstd]), f"{prefix}w"])
    return b.op(f"{prefix}out", "BiasAdd", [scaled, f"{prefix}bias"])


def layer_norm(rows: int = 128, width: int = 768, dtype: str = "fp32", residual: bool = True) -> Graph:
    """``LayerNorm(x + r)`` written in the op table's primitives (``residual``: the residual add before the norm)."""
    b = GraphBuilder(f"layer-norm-{rows}x{width}-{dtype}")
    x = b.input("x", (rows, width), dtype)
    if residual:
        b.input("r", (rows, width), dtype)
        x = b.op("res", "Add", ["x", "r"])
    return b.build([layer_norm_ops(b, x, width, dtype)])


def rms_norm(rows: int = 128, width: int = 768, dtype: str = "bf16", residual: bool = True) -> Graph:
    """``RMSNorm(x + r)`` as LLaMA writes it: the statistics in fp32 (``x.to(float32)``, ``pow(2).mean(-1)``,
    ``rsqrt``), the normalised rows cast back to ``dtype``, then times the weight."""
    b = GraphBuilder(f"rms-norm-{rows}x{width}-{dtype}")
    x = b.input("x", (rows, width), dtype)
    b.input("w", (width,), dtype)
    if residual:
        b.input("r", (rows, width), dtype)
        x = b.op("res", "Add", ["x", "r"])
    wide = b.op("wide", "Cast", [x], {"dtype": "fp32"}) if dtype != "fp32" else x
    mean = b.op("ms", "RowMean", [b.op("square", "Square", [wide])])
    normed = b.op("normed", "MulRow", [wide, b.op("rstd", "Rsqrt", [b.op("eps", "Affine", [mean], {"a": 1.0, "b": 1e-6})])])
    narrow = b.op("narrow", "Cast", [normed], {"dtype": dtype}) if dtype != "fp32" else normed
    return b.build([b.op("out", "BiasMul", [narrow, "w"])])


def softmax(rows: int = 128, width: int = 128, dtype: str = "fp32") -> Graph:
    """Softmax over the last dimension: exp(x - max) / sum."""
    b = GraphBuilder(f"softmax-{rows}x{width}-{dtype}")
    b.input("x", (rows, width), dtype)
    b.op("top", "RowMax", ["x"])
    b.op("shifted", "SubRow", ["x", "top"])
    b.op("e", "Exp", ["shifted"])
    b.op("total", "RowSum", ["e"])
    return b.build([b.op("out", "DivRow", ["e", "total"])])


def attention_ops(b: GraphBuilder, name: str, qkv: tuple[str, str, str] | str, *, batch: int, seq: int,
                  heads: int, width: int, causal: bool = True, mask: str | None = None, bias: str | None = None) -> str:
    """Multi-head attention over token rows (batch*seq, .) in the op table's primitives, as the torch importer
    writes ``scaled_dot_product_attention``: each of q, k, v taken head-major (``Heads``; from one packed
    (batch*seq, 3*width) projection when ``qkv`` is one tensor), softmax(q@k^T / sqrt(d)) from
    ``BatchScores``, ``Affine`` and the row ops, applied to v (``BatchApply``), the heads merged back.
    ``mask``: an additive padding mask (batch, T), repeated over the heads and added to the scaled scores;
    ``bias``: a row of keys per query (batch*heads, S, T) added to them (T5's relative position bias)."""
    srcs = (qkv,) * 3 if isinstance(qkv, str) else qkv
    offsets = (0, width, 2 * width) if isinstance(qkv, str) else (0, 0, 0)
    q, k, v = (b.op(f"{name}.{t}h", "Heads", [src], {"heads": heads, "seq": seq, "offset": off, "width": width})
               for t, src, off in zip("qkv", srcs, offsets, strict=True))
    s = b.op(f"{name}.scores", "BatchScores", [q, k], {"causal": int(causal)})
    s = b.op(f"{name}.scaled", "Affine", [s], {"a": 1.0 / math.sqrt(width // heads), "b": 0.0})
    if mask is not None:
        rows = b.op(f"{name}.mask", "GroupRepeat", [mask], {"heads": heads, "rows": 1})
        s = b.op(f"{name}.masked", "MaskAdd", [s, rows])
    if bias is not None:
        s = b.op(f"{name}.biased", "Add", [s, bias])
    top = b.op(f"{name}.max", "RowMax", [s])
    e = b.op(f"{name}.exp", "Exp", [b.op(f"{name}.shifted", "SubRow", [s, top])])
    p = b.op(f"{name}.probs", "DivRow", [e, b.op(f"{name}.sum", "RowSum", [e])])
    return b.op(name, "Merge", [b.op(f"{name}.heads", "BatchApply", [p, v])], {"heads": heads})


def attention(batch: int = 1, seq: int = 128, d_model: int = 768, heads: int = 12, dtype: str = "fp32",
              causal: bool = True, masked: bool = False, biased: bool = False) -> Graph:
    """Causal multi-head attention of a packed qkv projection (batch*seq, 3*d_model), primitives only
    (``masked``: not causal, with an additive padding mask input (batch, seq), as BERT's; ``biased``: not causal,
    with a position bias input (batch*heads, seq, seq) added to the scores, as T5's)."""
    causal = causal and not masked and not biased
    b = GraphBuilder(f"attention-b{batch}-s{seq}-d{d_model}-h{heads}-{dtype}" + ("-causal" if causal else "")
                     + ("-masked" if masked else "") + ("-biased" if biased else ""))
    b.input("qkv", (batch * seq, 3 * d_model), dtype)
    mask = b.input("mask", (batch, seq), dtype) if masked else None
    bias = b.input("bias", (batch * heads, seq, seq), dtype) if biased else None
    return b.build([attention_ops(b, "attn", "qkv", batch=batch, seq=seq, heads=heads, width=d_model, causal=causal,
                                  mask=mask, bias=bias)])


def rope_ops(b: GraphBuilder, name: str, x: str, cos: str, sin: str) -> str:
    """Rotary position embeddings of head-major ``x`` (batch*heads, seq, d), as LLaMA writes them:
    ``x*cos + rotate_half(x)*sin`` with (seq, d) tables repeated over batch and heads."""
    rotated = b.op(f"{name}.rot", "TileMul", [b.op(f"{name}.half", "RotateHalf", [x]), sin])
    return b.op(name, "Add", [b.op(f"{name}.cos", "TileMul", [x, cos]), rotated])


def rope(batch: int = 1, seq: int = 128, d_model: int = 768, heads: int = 12, dtype: str = "fp32",
         norm: bool = False) -> Graph:
    """The query heads of token rows (batch*seq, d_model) with RoPE applied (``norm``: then an RMSNorm over
    each head, as Qwen3 and OLMo2 normalise q and k, so the RoPE runs inside a row kernel)."""
    if d_model % heads or (d_model // heads) % 2:
        raise ValueError(f"rope: d_model {d_model} must split into {heads} heads of an even size")
    hd = d_model // heads
    b = GraphBuilder(f"rope-b{batch}-s{seq}-d{d_model}-h{heads}-{dtype}" + ("-norm" if norm else ""))
    b.input("x", (batch * seq, d_model), dtype)
    b.input("cos", (seq, hd), dtype)
    b.input("sin", (seq, hd), dtype)
    q = b.op("q", "Heads", ["x"], {"heads": heads, "seq": seq, "offset": 0, "width": d_model})
    out = rope_ops(b, "rope", q, "cos", "sin")
    if norm:
        mean = b.op("rope.ms", "RowMean", [b.op("rope.sq", "Square", [out])])
        out = b.op("rope.normed", "MulRow", [out, b.op("rope.rstd", "Rsqrt", [b.op("rope.eps", "Affine", [mean], {"a": 1.0, "b": 1e-6})])])
    return b.build([out])


def mlp_stack(layers: int = 4, d: int = 1024, m: int = 64, dtype: str = "fp16") -> Graph:
    """``layers`` mlp-epilogue blocks; each block's residual is its own input."""
    b = GraphBuilder(f"mlp-stack-L{layers}-d{d}-m{m}-{dtype}")
    x = b.input("x", (m, d), dtype)
    for i in range(layers):
        b.input(f"w{i}", (d, d), dtype)
        b.input(f"b{i}", (d,), dtype)
        mm = b.op(f"mm{i}", "MatMul", [x, f"w{i}"])
        bias = b.op(f"bias{i}", "BiasAdd", [mm, f"b{i}"])
        g = b.op(f"gelu{i}", "GeluTanh", [bias])
        x = b.op(f"res{i}", "Add", [g, x])
    return b.build([x])


def transformer(
    layers: int = 2,
    d_model: int = 1024,
    seq: int = 128,
    dtype: str = "fp16",
    mlp: str = "gelu",
    heads: int | None = None,
) -> Graph:
    """A pre-LN decoder stack: LN, q/k/v projections, causal attention, output projection and
    residual; LN, MLP (GELU or SwiGLU) and residual, all in the op table's primitives: the
    LayerNorms are row ops and the attention is ``Heads``, ``BatchScores``, the softmax's row
    ops, ``BatchApply`` and ``Merge`` (:func:`attention_ops`), which the rules fuse."""
    if mlp not in ("gelu", "swiglu"):
        raise ValueError(f"--mlp must be 'gelu' or 'swiglu', got {mlp!r}")
    heads = heads or max(1, d_model // 64)
    if d_model % heads:
        raise ValueError(f"--d-model {d_model} is not a multiple of the {heads} heads")
    b = GraphBuilder(f"transformer-L{layers}-d{d_model}-s{seq}-{dtype}-{mlp}")
    x = b.input("x", (seq, d_model), dtype)
    hidden = 4 * d_model if mlp == "gelu" else (8 * d_model) // 3

    def linear(name: str, inp: str, d_in: int, d_out: int, bias: bool = True) -> str:
        b.input(f"{name}.w", (d_in, d_out), dtype)
        y = b.op(f"{name}.mm", "MatMul", [inp, f"{name}.w"])
        if bias:
            b.input(f"{name}.b", (d_out,), dtype)
            y = b.op(f"{name}.bias", "BiasAdd", [y, f"{name}.b"])
        return y

    for i in range(layers):
        p = f"l{i}"
        h = layer_norm_ops(b, x, d_model, dtype, f"{p}.ln1.")
        q, k, v = (linear(f"{p}.{t}", h, d_model, d_model) for t in "qkv")
        att = attention_ops(b, f"{p}.attn", (q, k, v), batch=1, seq=seq, heads=heads, width=d_model)
        x = b.op(f"{p}.res1", "Add", [x, linear(f"{p}.o", att, d_model, d_model)])
        h = layer_norm_ops(b, x, d_model, dtype, f"{p}.ln2.")
        if mlp == "gelu":
            u = b.op(f"{p}.gelu", "GeluTanh", [linear(f"{p}.up", h, d_model, hidden)])
            d = linear(f"{p}.down", u, hidden, d_model)
        else:
            gate = b.op(f"{p}.silu", "Silu", [linear(f"{p}.gate", h, d_model, hidden, bias=False)])
            u = b.op(f"{p}.glu", "Mul", [gate, linear(f"{p}.up", h, d_model, hidden, bias=False)])
            d = linear(f"{p}.down", u, hidden, d_model, bias=False)
        x = b.op(f"{p}.res2", "Add", [x, d])
    return b.build([x])


def token_mlp(tokens: int = 64, vocab: int = 1000, d_model: int = 256, hidden: int = 512, dtype: str = "bf16") -> Graph:
    """A language model's first steps as the torch importer reads them (Phi-3's MLP): token ids (carried as
    fp32) looked up in a table (``Embedding``), one packed gate/up projection taken apart (``Columns``), SwiGLU
    and the down projection."""
    b = GraphBuilder(f"token-mlp-t{tokens}-v{vocab}-d{d_model}-h{hidden}-{dtype}")
    b.input("ids", (tokens,), "fp32")
    b.input("table", (vocab, d_model), dtype)
    b.input("gate_up.w", (d_model, 2 * hidden), dtype)
    b.input("down.w", (hidden, d_model), dtype)
    packed = b.op("gate_up", "MatMul", [b.op("embed", "Embedding", ["ids", "table"]), "gate_up.w"])
    gate = b.op("gate", "Columns", [packed], {"offset": 0, "width": hidden})
    up = b.op("up", "Columns", [packed], {"offset": hidden, "width": hidden})
    glu = b.op("glu", "Mul", [b.op("silu", "Silu", [gate]), up])
    return b.build([b.op("down", "MatMul", [glu, "down.w"])])


def conv_block(batch: int = 1, channels: int = 64, size: int = 56, dtype: str = "fp16") -> Graph:
    """ResNet's basic block as the torch importer reads one, then its pooling: the image batch (torch's order)
    stored channels last, two 3x3 convolutions (Im2col, the GEMM, the folded BatchNorm's bias, ReLU; the second
    adds the residual), 3x3 stride-2 max pooling and global average pooling, the block's output also in torch's
    order again."""
    b = GraphBuilder(f"conv-block-n{batch}-c{channels}-s{size}-{dtype}")
    b.input("x", (batch * channels * size, size), dtype)
    window = {"height": size, "width": size, "kh": 3, "kw": 3, "sh": 1, "sw": 1, "ph": 1, "pw": 1, "dh": 1, "dw": 1}
    rows = b.op("rows", "ChannelsLast", ["x"], {"channels": channels, "pixels": size * size})
    y = rows
    for i in (1, 2):
        b.input(f"conv{i}.w", (9 * channels, channels), dtype)
        b.input(f"conv{i}.b", (channels,), dtype)
        mm = b.op(f"conv{i}", "MatMul", [b.op(f"patches{i}", "Im2col", [y], window), f"conv{i}.w"])
        y = b.op(f"conv{i}.bias", "BiasAdd", [mm, f"conv{i}.b"])
        y = b.op(f"relu{i}", "Relu", [b.op("residual", "Add", [y, rows]) if i == 2 else y])
    pooled = b.op("pool", "MaxPool", [y], {**window, "sh": 2, "sw": 2})
    mean = b.op("mean", "SpatialMean", [pooled], {"pixels": ((size - 1) // 2 + 1) ** 2})
    return b.build([mean, b.op("out", "ChannelsFirst", [y], {"pixels": size * size, "width": size})])


EXAMPLES = ("mlp-epilogue", "heavy", "ew-chain", "mlp-stack", "transformer")


# ---------------------------------------------------------------- one op of the table


def fusable_ops() -> list[str]:
    """The ops a kernel computes in registers (elementwise ops and reductions), in table order."""
    return [name for name, op in OPS.items() if op.kind.fuses]


def example_shapes(op: OpDef, near: Shape = (3, 8)) -> tuple[Shape, tuple[Shape, ...]] | None:
    """The first input's shape (``near``, or one leading dimension more) and the further inputs' shapes of an
    example of ``op``; None where its shape rule gives none."""
    for first in (near, (2, *near)):
        operands = example_operands(op, first)
        if operands is not None:
            return first, operands
    return None


def example_attrs(op: OpDef) -> dict[str, Any]:
    """The first example value of each of ``op``'s attributes (OpError naming one that has none)."""
    out = {}
    for a in op.attrs:
        values = a.example_values()
        if not values:
            raise OpError(f"{op.name}: attribute {a.name!r} has no default, choices or example values, so no "
                          "example of the op can be drawn (AttrSpec.examples)")
        out[a.name] = values[0]
    return out


def positive_value(b: GraphBuilder, x: str, name: str) -> str:
    """``sigmoid(x) + 0.5``: a value in (0.5, 1.5), for an input an op needs positive (``OpDef.positive_inputs``)."""
    return b.op(f"{name}.pos", "Affine", [b.op(f"{name}.sig", "Sigmoid", [x])], {"a": 1.0, "b": 0.5})


def op_example(name: str, dtype: str = "fp32", rows: int = 3, cols: int = 8,
               attrs: Mapping[str, Any] | None = None) -> Graph:
    """One op of the table between neighbours it may fuse with: an ``Affine`` before each input a kernel may
    read from registers (a positive value where the op needs one), the op, and a consumer after it (``Neg``;
    for a reduction ``SubRow`` of its input, so that one row kernel can hold both).  The shapes come from the
    op's shape rule, the attributes from its AttrSpecs (``attrs`` overrides them); an OpError names what the
    entry lacks for an example."""
    op = op_def(name)
    if not op.kind.fuses or op.arity is None:
        raise OpError(f"{name}: op_example takes an elementwise op or a reduction, not a {op.kind} op")
    shapes = example_shapes(op, (rows, cols))
    if shapes is None:
        raise OpError(f"{name}: its shape rule gives no example operands (use a ShapeRule of planner.core.shapes)")
    first, operands = shapes
    b = GraphBuilder(f"example-{name}-{dtype}")
    inputs = []
    for i, shape in enumerate((first, *operands)):
        x = b.input(f"x{i}", shape, dtype)
        if i in op.positive_inputs:
            x = positive_value(b, x, f"in{i}")
        elif i in op.fusable_inputs:
            x = b.op(f"in{i}", "Affine", [x], {"a": 1.5, "b": 0.25})
        inputs.append(x)
    y = b.op("op", name, inputs, {**example_attrs(op), **(attrs or {})})
    if op.kind == OpKind.REDUCTION:
        return b.build([b.op("after", "SubRow", [inputs[0], y])])
    return b.build([b.op("after", "Neg", [y])])

"""Lowerings of elementwise calls: activations, tensor-tensor and tensor-scalar arithmetic, powers, casts and the
views that keep the flattened shape."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from planner.torch.errors import TorchImportError
from planner.torch.heads import takes_columns
from planner.torch.lowerings.layouts import affine, alias, cast, masked_scores, settle, tiles
from planner.torch.lowerings.registry import lowering
from planner.torch.walk import (
    CHANNELS_LAST,
    Importer,
    Traced,
    is_scalar,
    is_tensor,
)


@lowering("relu", becomes="Relu")
def lower_relu(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return imp.unary(node, "Relu", args[0], concrete)


@lowering("silu", becomes="Silu")
def lower_silu(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    if kwargs.get("inplace") or (len(args) > 1 and args[1]):
        return None
    return imp.unary(node, "Silu", args[0], concrete)


@lowering("gelu", becomes="GeluTanh (approximate='tanh') or GeluErf (the exact form)")
def lower_gelu(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    approx = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    op = {"tanh": "GeluTanh", "none": "GeluErf"}.get(approx)
    return imp.unary(node, op, args[0], concrete) if op else None


#: the bounds a clamp-like call takes, by the call's last name: (positional names after x, defaults)
_CLAMP_FORMS: dict[str, tuple[tuple[str, ...], tuple[Any, ...]]] = {
    "clamp": (("min", "max"), (None, None)), "clip": (("min", "max"), (None, None)),
    "clamp_min": (("min",), (None,)), "clamp_max": (("max",), (None,)),
    "hardtanh": (("min_val", "max_val"), (-1.0, 1.0)), "relu6": ((), ()),
}


def clamp_bounds(node: fx.Node, args: Any, kwargs: Any) -> tuple[float | None, float | None] | None:
    """(lower, upper) bound of a clamp, hardtanh or relu6 call (None: that side is open), or None where a bound
    is not a number (a tensor of bounds stays a torch call)."""
    t = node.target  # a method's name, an ATen overload (its _opname) or a function
    name = (t if isinstance(t, str) else str(getattr(t, "_opname", getattr(t, "__name__", "")))).removesuffix("_")
    if name not in _CLAMP_FORMS:
        return None
    names, defaults = _CLAMP_FORMS[name]
    given = dict(zip(names, args[1:], strict=False))
    values = [kwargs.get(n, given.get(n, d)) for n, d in zip(names, defaults, strict=True)]
    if name == "relu6":
        return 0.0, 6.0
    if any(v is not None and not is_scalar(v) for v in values):
        return None
    bounds = dict(zip(names, values, strict=True))
    lo = bounds.get("min", bounds.get("min_val"))
    hi = bounds.get("max", bounds.get("max_val"))
    return (None if lo is None else float(lo)), (None if hi is None else float(hi))


@lowering("clamp", becomes="Clamp (number bounds: clamp, clip, clamp_min, clamp_max, hardtanh, relu6)")
def lower_clamp(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    bounds = clamp_bounds(node, args, kwargs) if args else None
    if bounds is None or not isinstance(concrete, torch.Tensor) or not concrete.is_floating_point():
        return None
    lo, hi = bounds
    if (lo is None and hi is None) or any(b is not None and not math.isfinite(b) for b in bounds):
        return None
    sides = "both" if lo is not None and hi is not None else ("min" if lo is not None else "max")
    attrs = {"lo": 0.0 if lo is None else lo, "hi": 0.0 if hi is None else hi, "sides": sides}
    return imp.unary(node, "Clamp", args[0], concrete, attrs)


@lowering("leaky_relu", becomes="LeakyRelu")
def lower_leaky_relu(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    slope = kwargs.get("negative_slope", args[1] if len(args) > 1 else 0.01)
    if not is_scalar(slope) or not math.isfinite(float(slope)) or not isinstance(concrete, torch.Tensor):
        return None
    return imp.unary(node, "LeakyRelu", args[0], concrete, {"slope": float(slope)})


@lowering("hardswish", becomes="Hardswish")
def lower_hardswish(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return imp.unary(node, "Hardswish", args[0], concrete) if args and isinstance(concrete, torch.Tensor) else None


@lowering("hardsigmoid", becomes="Hardsigmoid")
def lower_hardsigmoid(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return imp.unary(node, "Hardsigmoid", args[0], concrete) if args and isinstance(concrete, torch.Tensor) else None


def binary(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any, kind: str) -> Any:
    if kwargs.get("alpha", 1) != 1 or len(args) != 2 or kwargs.get("rounding_mode") is not None:
        return None
    a, c = args
    if not isinstance(concrete, torch.Tensor):
        return None
    if isinstance(a, Traced) and is_scalar(c):
        coef = {"add": (1.0, c), "sub": (1.0, -c), "mul": (c, 0.0), "div": (1.0 / c if c else None, 0.0)}[kind]
        return None if coef[0] is None else affine(imp, node, a, coef[0], coef[1], concrete)
    if isinstance(c, Traced) and is_scalar(a):
        coef = {"add": (1.0, a), "sub": (-1.0, a), "mul": (a, 0.0), "div": (None, 0.0)}[kind]
        return None if coef[0] is None else affine(imp, node, c, coef[0], coef[1], concrete)
    if not (is_tensor(a) and is_tensor(c)):
        return None
    if kind == "mul":
        scaled = per_image_scale(imp, node, a, c, concrete)
        if scaled is not None:
            return scaled
    if any(isinstance(v, Traced) and v.layout == CHANNELS_LAST for v in (a, c)):
        kept = channels_last_binary(imp, node, a, c, concrete, kind)
        if kept is not None:
            return kept
        a, c = imp.plain(a), imp.plain(c)
    if a.dtype != c.dtype:  # torch computes in the promoted dtype (bf16 * fp32 is fp32)
        a, c = cast(imp, node, a, concrete.dtype) or a, cast(imp, node, c, concrete.dtype) or c
        if a.dtype != c.dtype:
            return None
    out = tuple(concrete.shape)
    a, c = settle(imp, a), settle(imp, c)
    if tuple(a.shape) == tuple(c.shape) == out:
        op = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "maximum": "Maximum", "minimum": "Minimum"}[kind]
        if isinstance(a, torch.Tensor) or isinstance(c, torch.Tensor):  # a constant, bound in the value's layout
            return broadcast_constant(imp, node, a, c, out, concrete.dtype, kind)
        ia, ic = imp.use(a, node.name), imp.use(c, f"{node.name}_rhs")
        if imp.b.shape_of(ia) != imp.b.shape_of(ic):
            return None  # one head-major, one in token rows: torch computes it (an Opaque takes both)
        return imp.emit(node, op, [ia, ic], None, out, concrete.dtype)
    row_vector = {"add": "BiasAdd", "mul": "BiasMul"}.get(kind)
    if row_vector and len(out) >= 2:
        for x, vec in ((a, c), (c, a)):
            if tuple(x.shape) == out and tuple(vec.shape) == (out[-1],):
                return imp.emit(node, row_vector, [imp.use(x, node.name), imp.use(vec, f"{node.name}_rhs")],
                                 None, out, concrete.dtype)
    tiled = {"add": "TileAdd", "mul": "TileMul"}.get(kind)
    if tiled and len(out) >= 3:  # RoPE's x * cos: a (1, .., 1, seq, d) table over (batch, heads, seq, d)
        for x, t in ((a, c), (c, a)):
            if tuple(x.shape) == out and tiles(imp, x, t, out):
                return imp.emit(node, tiled, [imp.use(x, node.name), imp.use(t, f"{node.name}_rhs")], None, out,
                                 concrete.dtype)
    if kind == "add" and len(out) == 4:  # eager attention's scores + attention_mask
        for x, m in ((a, c), (c, a)):
            masked = masked_scores(imp, node, x, m, out, concrete.dtype)
            if masked is not None:
                return masked
    if kind in ("add", "sub", "mul", "div") and len(out) >= 1:  # one value per row, e.g. x - x.mean(-1, keepdim=True)
        per_row = (*out[:-1], 1)
        pairs = ((a, c), (c, a)) if kind in ("add", "mul") else ((a, c),)
        for x, r in pairs:
            if tuple(x.shape) == out and tuple(r.shape) == per_row and out[-1] != 1:
                op = {"add": "AddRow", "sub": "SubRow", "mul": "MulRow", "div": "DivRow"}[kind]
                return imp.emit(node, op, [imp.use(x, node.name), imp.use(r, f"{node.name}_row")], None, out,
                                 concrete.dtype)
    return broadcast_constant(imp, node, a, c, out, concrete.dtype, kind)


def per_image_scale(imp: Importer, node: fx.Node, a: Any, c: Any, concrete: torch.Tensor) -> Any:
    """``x * s`` of an image batch x (N, C, *pixels) and a value per image and channel s (N, C, 1, ...) the module
    computes (squeeze-and-excitation's weights), one of them stored channels last already: PixelMul of both
    channels last, the result channels last; else None."""
    out, dtype = tuple(concrete.shape), concrete.dtype
    if len(out) not in (3, 4) or not any(isinstance(v, Traced) and v.layout == CHANNELS_LAST for v in (a, c)):
        return None  # no image batch here (a (B, S, 1) row statistic times (B, S, D) tokens is MulRow)
    for x, s in ((a, c), (c, a)):
        if (isinstance(x, Traced) and x.runtime and x.shape == out and x.dtype == dtype and isinstance(s, Traced)
                and s.runtime and s.dtype == dtype and tuple(s.shape) == (*out[:2], *([1] * (len(out) - 2)))
                and math.prod(out[2:]) > 1):
            ids = [imp.channels_last(x, f"{node.name}_x"), imp.channels_last(s, f"{node.name}_s")]
            return imp.emit(node, "PixelMul", ids, None, out, dtype, layout=CHANNELS_LAST)
    return None


def channels_last_binary(imp: Importer, node: fx.Node, a: Any, c: Any, concrete: torch.Tensor, kind: str) -> Any:
    """``a <op> c`` of image batches of one shape (a residual add), one of them channels last: both channels
    last, the result too; or one and a constant per channel ((C, 1, 1), BatchNorm written out) as a row
    vector. None otherwise (then in torch's order)."""
    out, dtype = tuple(concrete.shape), concrete.dtype
    op = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "maximum": "Maximum", "minimum": "Minimum"}[kind]
    if all(isinstance(v, Traced) and v.shape == out and v.dtype == dtype for v in (a, c)):
        ids = [imp.channels_last(v, f"{node.name}_{i}") for i, v in enumerate((a, c))]
        return imp.emit(node, op, ids, None, out, dtype, layout=CHANNELS_LAST)
    vector = {"add": "BiasAdd", "mul": "BiasMul"}.get(kind)
    for x, k in ((a, c), (c, a)):
        per_channel = isinstance(k, torch.Tensor) and k.dtype == dtype and k.dim() >= 2 and k.numel() == out[1] \
            and (1,) * (len(out) - k.dim()) + tuple(k.shape) == (1, out[1], *([1] * (len(out) - 2)))
        if vector and isinstance(x, Traced) and x.layout == CHANNELS_LAST and x.shape == out and per_channel:
            assert x.id is not None
            return imp.emit(node, vector, [x.id, imp.use(k.reshape(-1), f"{node.name}_channels")], None, out, dtype,
                            layout=CHANNELS_LAST)
    return None


def broadcast_constant(imp: Importer, node: fx.Node, a: Any, c: Any, out: tuple[int, ...], dtype: torch.dtype,
                       kind: str) -> Any:
    """``a <op> c`` where one operand is a value of the result's shape and the other a constant torch broadcasts
    over it (T5's relative position bias (1, heads, S, T) over the batch's scores): the constant bound expanded,
    in the value's layout, and the two-tensor op."""
    x, k = (a, c) if isinstance(c, torch.Tensor) else (c, a)
    if not (isinstance(x, Traced) and isinstance(k, torch.Tensor) and tuple(x.shape) == out and k.dtype == dtype):
        return None
    try:
        expanded = k.expand(out)
    except RuntimeError:
        return None
    ix = imp.use(x, node.name)
    ik = imp.use(expanded, f"{node.name}_const", ir_shape=tuple(imp.b.shape_of(ix)))
    op = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "maximum": "Maximum", "minimum": "Minimum"}[kind]
    return imp.emit(node, op, [ix, ik] if x is a else [ik, ix], None, out, dtype)


@lowering("add",
          becomes=(
           "Add; BiasAdd (a row vector); TileAdd (a table repeated over heads); MaskAdd (attention scores + a "
           "mask); AddRow (one value per row); Affine (a scalar)"))
def lower_add(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return binary(imp, node, args, kwargs, concrete, "add")


@lowering("sub", becomes="Sub; SubRow (one value per row); Affine (a scalar)")
def lower_sub(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return binary(imp, node, args, kwargs, concrete, "sub")


@lowering("mul",
          becomes=(
           "Mul; BiasMul (a row vector); TileMul (RoPE's tables); MulRow (one value per row); PixelMul (an image "
           "batch by a value per image and channel); Affine (a scalar)"))
def lower_mul(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return binary(imp, node, args, kwargs, concrete, "mul")


@lowering("div", becomes="Div; DivRow (one value per row); Affine (by a scalar)")
def lower_div(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return binary(imp, node, args, kwargs, concrete, "div")


@lowering("maximum", becomes="Maximum (two tensors)")
def lower_maximum(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return binary(imp, node, args, kwargs, concrete, "maximum") if all(is_tensor(a) for a in args) else None


@lowering("minimum", becomes="Minimum (two tensors)")
def lower_minimum(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return binary(imp, node, args, kwargs, concrete, "minimum") if all(is_tensor(a) for a in args) else None


@lowering("neg", becomes="Neg")
def lower_neg(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    x = args[0] if args else None
    if isinstance(x, Traced) and x.program is not None and takes_columns(x.program.steps[-1]):
        return None  # -x[..., d/2:] of rotate_half: kept with its slice, so the cat is recognised as a whole
    return imp.unary(node, "Neg", x, concrete)


@lowering("pow", becomes="Square (p = 2), Square then Mul (3), Sqrt (0.5), Rsqrt (-0.5)")
def lower_pow(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    """``x ** p`` with a constant ``p`` of 2, 3, 0.5 or -0.5: Square, Square then Mul, Sqrt, Rsqrt."""
    if len(args) != 2 or kwargs or not isinstance(args[0], Traced) or not is_scalar(args[1]):
        return None
    x, p = args[0], float(args[1])
    if not isinstance(concrete, torch.Tensor):
        return None
    ops = {2.0: "Square", 0.5: "Sqrt", -0.5: "Rsqrt"}
    if p in ops:
        return imp.unary(node, ops[p], x, concrete)
    if p == 3.0:
        sq = imp.emit(node, "Square", [imp.use(x, node.name)], None, concrete.shape, concrete.dtype, "_sq")
        return imp.emit(node, "Mul", [sq.id, imp.use(x, f"{node.name}_x")], None, concrete.shape, concrete.dtype)
    return None


@lowering("rsub", becomes="Affine (a scalar minus x)")
def lower_rsub(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    if isinstance(args[0], Traced) and is_scalar(args[1]) and is_scalar(alpha):
        return affine(imp, node, args[0], -float(alpha), float(args[1]), concrete)
    return None


@lowering("view", becomes="a view of its input, no op (reshape, flatten, unsqueeze, squeeze)")
def lower_view(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return alias(imp, args[0], concrete)


@lowering("slice", becomes="a view of its input when it keeps every element (x[..., :n] of n columns), else torch's")
def lower_slice(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    x = args[0] if args else None
    if isinstance(x, Traced) and isinstance(concrete, torch.Tensor) and tuple(concrete.shape) == x.shape:
        return x
    return None


@lowering("cat", becomes="its one non-empty part, no op (cat((rotated, x[..., d:])) with nothing passed through); "
                         "else torch's (RotateHalf is recognised in it)")
def lower_cat(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    parts = args[0] if args and isinstance(args[0], (list, tuple)) else None
    if parts is None or not isinstance(concrete, torch.Tensor):
        return None
    kept = [p for p in parts if not (is_tensor(p) and math.prod(p.shape) == 0)]
    if len(kept) == 1 and isinstance(kept[0], Traced) and kept[0].shape == tuple(concrete.shape) \
            and kept[0].dtype == concrete.dtype:
        return kept[0]
    return None


@lowering("same", becomes="a view of its input, no op (contiguous, clone, detach)")
def lower_same(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return alias(imp, args[0], concrete)


@lowering("to", becomes="Cast (to another dtype), else a view")
def lower_to(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    x = args[0] if args else None
    if isinstance(x, Traced) and isinstance(concrete, torch.Tensor) and concrete.dtype != x.dtype:
        return cast(imp, node, x, concrete.dtype) if concrete.shape == x.shape else None
    return alias(imp, x, concrete)


@lowering("expand", becomes="GroupRepeat (repeat_kv of grouped-query attention)")
def lower_expand(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    """``repeat_kv``'s ``x[:, :, None].expand(b, kv, n, t, d)`` of head-major keys or values (grouped-query
    attention): ``GroupRepeat``, each head repeated for its n query heads (the reshape after it is free)."""
    x = settle(imp, args[0]) if args else None
    if not (isinstance(x, Traced) and x.id is not None and isinstance(concrete, torch.Tensor) and len(x.shape) == 5):
        return None
    b, kv, one, t, d = x.shape
    out = tuple(concrete.shape)
    if one != 1 or out[:2] != (b, kv) or out[3:] != (t, d) or imp.b.shape_of(x.id) != (b * kv, t, d):
        return None
    return imp.emit(node, "GroupRepeat", [x.id], {"heads": out[2], "rows": t}, out, x.dtype)


@lowering("dropout", becomes="a view in eval mode (refused in training mode)")
def lower_dropout(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    if train and p:
        raise TorchImportError(f"{imp.where(node)}: dropout in training mode is random; call module.eval() first")
    return alias(imp, args[0], concrete)

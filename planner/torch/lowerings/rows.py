"""Lowerings of row ops: reductions over the last dimension, softmax, LayerNorm and RMSNorm, and attention
(``scaled_dot_product_attention``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from planner.torch.binding import TORCH_DTYPES
from planner.torch.lowerings.images import spatial_mean
from planner.torch.lowerings.layouts import causal_mask, computed_mask, head_major, mask_layout, masked_scores
from planner.torch.lowerings.registry import lowering
from planner.torch.walk import (
    CHANNELS_LAST,
    Importer,
    Traced,
    is_scalar,
    reduces_rows,
)


def reduction(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any, op: str) -> Any:
    """``x.mean(-1, keepdim=True)`` (``sum``, ``amax``): the op-table reduction over the last dimension."""
    x = args[0] if args else kwargs.get("input")
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    if len(dims) != 1 or not reduces_rows(x, concrete, dims[0]) or keep is not True or kwargs.get("dtype"):
        return None
    return imp.emit(node, op, [imp.use(x, node.name)], None, concrete.shape, concrete.dtype)


@lowering("mean", becomes="RowMean (over the last dimension, kept); SpatialMean (over an image's pixels)")
def lower_mean(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    x = args[0] if args else kwargs.get("input")
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    # over an image's pixels: a 2-D image's two, or a channels-last 1-D one's (a row mean is the same numbers)
    if (isinstance(x, Traced) and (len(x.shape) == 4 or (len(x.shape) == 3 and x.layout == CHANNELS_LAST))
            and all(isinstance(d, int) for d in dims) and not kwargs.get("dtype")
            and sorted(d % len(x.shape) for d in dims) == list(range(2, len(x.shape)))
            and isinstance(concrete, torch.Tensor) and concrete.dtype == x.dtype):
        return spatial_mean(imp, node, x, concrete, keep=bool(keep))
    return reduction(imp, node, args, kwargs, concrete, "RowMean")


@lowering("sum", becomes="RowSum (over the last dimension, kept)")
def lower_sum(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return reduction(imp, node, args, kwargs, concrete, "RowSum")


@lowering("amax", becomes="RowMax (over the last dimension, kept)")
def lower_amax(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    return reduction(imp, node, args, kwargs, concrete, "RowMax")


@lowering("softmax", becomes="RowMax, SubRow, Exp, RowSum, DivRow (one row kernel once fused)")
def lower_softmax(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    """softmax over the last dimension: exp(x - max) / sum, one row kernel once fused."""
    x = args[0] if args else kwargs.get("input")
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    extra = args[2] if len(args) > 2 else None  # aten.softmax.int's dtype, or aten._softmax's half_to_float
    want = extra if isinstance(extra, torch.dtype) else kwargs.get("dtype")
    if (not reduces_rows(x, concrete, dim) or (want is not None and want != x.dtype)  # eager attention's dtype=float32
            or (extra not in (None, False) and not isinstance(extra, torch.dtype))):
        return None
    shape, dt, stat = concrete.shape, concrete.dtype, (*concrete.shape[:-1], 1)
    xi = imp.use(x, node.name)
    top = imp.emit(node, "RowMax", [xi], None, stat, dt, "_max")
    e = imp.emit(node, "Exp", [imp.emit(node, "SubRow", [xi, top.id], None, shape, dt, "_shift").id], None,
                  shape, dt, "_exp")
    total = imp.emit(node, "RowSum", [e.id], None, stat, dt, "_sum")
    return imp.emit(node, "DivRow", [e.id, total.id], None, shape, dt)


@lowering("sdpa",
          becomes=(
           "Heads, BatchScores, Affine, MaskAdd, the softmax's row ops, BatchApply, Merge (fused into Attention "
           "or MaskedAttention); GroupRepeat for grouped-query attention"))
def lower_sdpa(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    """``scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)`` of heads taken out of token rows
    (``split``/``view``/``transpose``): ``Heads`` of each, softmax(scale * q@k^T) @ v from ``BatchScores``,
    ``Affine``, the row ops and ``BatchApply`` (no dropout).  An ``attn_mask`` broadcast over the heads
    ((batch or 1, 1, seq or 1, keys); float, or a constant bool one as 0 / -inf, or a bool one torch computes
    from the inputs as ``layouts.computed_mask``'s additive form) is repeated over the groups (``GroupRepeat``)
    and added to the scaled scores (``MaskAdd``; ``Add`` for a mask per query); a computed mask's query rows
    with no key are zeroed after, as torch's attention zeroes them, and a constant mask that is the causal
    triangle is ``is_causal``.  The rules fuse it into one ``Attention`` (``MaskedAttention``,
    ``BiasedAttention``) kernel; the heads are merged back where the result is transposed and reshaped."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args, strict=False)) | kwargs
    if (set(bound) - set(names) or bound.get("dropout_p", 0.0) != 0.0
            or not isinstance(bound.get("enable_gqa", False), bool)
            or not isinstance(bound.get("is_causal", False), bool)):
        return None
    if bound.get("attn_mask") is not None and bound.get("is_causal"):
        return None  # torch refuses both
    qkv = [bound.get(n) for n in names[:3]]
    if not all(isinstance(t, Traced) and t.dtype == concrete.dtype and len(t.shape) == 4 for t in qkv):
        return None
    if concrete.dtype not in TORCH_DTYPES or not all(head_major(imp, t) for t in qkv):
        return None
    scale = bound.get("scale")
    scale = 1.0 / math.sqrt(qkv[0].shape[-1]) if scale is None else scale  # torch's default: 1/sqrt(head dim)
    if not is_scalar(scale):
        return None
    scores_shape = (*qkv[0].shape[:-1], qkv[1].shape[-2])
    mask, kept, causal = bound.get("attn_mask"), None, bool(bound.get("is_causal", False))
    if causal_mask(mask, scores_shape):  # transformers' mask of a batch of several sequences and no padding
        mask, causal = None, True
    if isinstance(mask, Traced) and mask.dtype == torch.bool and mask.program is not None:
        found = computed_mask(imp, node, mask, scores_shape, concrete.dtype)
        if found is None:
            return None
        mask, kept = found
    elif isinstance(mask, Traced) and mask.program is not None and mask.dtype in TORCH_DTYPES:
        # a float mask torch computes from the inputs (a padding mask plus a bias per head): one Opaque node
        if mask_layout(imp, Traced(mask.shape, mask.dtype, True), scores_shape, concrete.dtype) is None:
            return None
        mask = Traced(mask.shape, mask.dtype, True, imp.materialise(mask))
    if mask is not None and mask_layout(imp, mask, scores_shape, concrete.dtype) is None:
        return None
    q, k, v = (imp.use(t, f"{node.name}_{name}") for t, name in zip(qkv, "qkv", strict=True))
    heads, kv_heads = qkv[0].shape[1], qkv[1].shape[1]
    if kv_heads != heads:  # grouped-query attention: each key and value head repeated for its query heads
        if not bound.get("enable_gqa") or qkv[2].shape[1] != kv_heads or heads % kv_heads:
            return None
        k, v = (imp.emit(node, "GroupRepeat", [t_id], {"heads": heads // kv_heads, "rows": t.shape[2]},
                          (t.shape[0], heads, *t.shape[2:]), t.dtype, f"_{name}_repeated").id
                for t_id, t, name in ((k, qkv[1], "k"), (v, qkv[2], "v")))
    stat, dt = (*scores_shape[:-1], 1), concrete.dtype
    scores = imp.emit(node, "BatchScores", [q, k], {"causal": int(causal)}, scores_shape,
                       dt, "_scores")
    scaled = imp.emit(node, "Affine", [scores.id], {"a": float(scale), "b": 0.0}, scores_shape, dt, "_scaled")
    if mask is not None:
        masked = masked_scores(imp, node, scaled, mask, scores_shape, dt)
        assert masked is not None  # its layout was checked above
        scaled = masked
    top = imp.emit(node, "RowMax", [scaled.id], None, stat, dt, "_max")
    e = imp.emit(node, "Exp", [imp.emit(node, "SubRow", [scaled.id, top.id], None, scores_shape, dt, "_shift").id],
                  None, scores_shape, dt, "_exp")
    probs = imp.emit(node, "DivRow", [e.id, imp.emit(node, "RowSum", [e.id], None, stat, dt, "_sum").id], None,
                      scores_shape, dt, "_probs")
    out = imp.emit(node, "BatchApply", [probs.id, v], None, concrete.shape, dt)
    return out if kept is None else imp.emit(node, "MulRow", [out.id, kept], None, concrete.shape, dt)


def norm(imp: Importer, node: fx.Node, x: Any, shape: Any, weight: Any, bias: Any, eps: Any, concrete: Any,
         rms: bool) -> Any:
    """LayerNorm (``rms``: RMSNorm) over the last dimension as the ops it is made of: the row
    statistics, ``(x - mean) * rsqrt(var + eps)`` (``x * rsqrt(mean(x*x) + eps)``), weight, bias."""
    if not reduces_rows(x, concrete) or tuple(shape or ()) != (x.shape[-1],):
        return None
    eps = float(torch.finfo(x.dtype).eps if eps is None else eps)  # torch's default: the input dtype's
    full, dt, stat = concrete.shape, concrete.dtype, (*concrete.shape[:-1], 1)
    xi = centred = imp.use(x, node.name)
    if not rms:
        mean = imp.emit(node, "RowMean", [xi], None, stat, dt, "_mean")
        centred = imp.emit(node, "SubRow", [xi, mean.id], None, full, dt, "_centred").id
    square = imp.emit(node, "Square", [centred], None, full, dt, "_square")
    var = imp.emit(node, "RowMean", [square.id], None, stat, dt, "_var")
    inv = imp.emit(node, "Rsqrt", [imp.emit(node, "Affine", [var.id], {"a": 1.0, "b": eps}, stat, dt, "_eps").id],
                    None, stat, dt, "_rstd")
    y = imp.emit(node, "MulRow", [centred, inv.id], None, full, dt, "_normed" if weight is not None or bias is not None else "")
    if weight is not None:
        y = imp.emit(node, "BiasMul", [y.id, imp.use(weight, f"{node.name}_weight")], None, full, dt,
                      "_scaled" if bias is not None else "")
    if bias is not None:
        y = imp.emit(node, "BiasAdd", [y.id, imp.use(bias, f"{node.name}_bias")], None, full, dt)
    return y


@lowering("layer_norm",
          becomes=(
           "RowMean, SubRow, Square, Affine, Rsqrt, MulRow, BiasMul, BiasAdd (one row kernel once fused)"))
def lower_layer_norm(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    a = {**dict(zip(names, args, strict=False)), **kwargs}
    if set(a) - set(names):
        return None
    return norm(imp, node, a.get("input"), a.get("normalized_shape"), a.get("weight"), a.get("bias"),
                     a.get("eps", 1e-5), concrete, rms=False)


@lowering("rms_norm", becomes="Square, RowMean, Affine, Rsqrt, MulRow, BiasMul (one row kernel once fused)")
def lower_rms_norm(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    names = ("input", "normalized_shape", "weight", "eps")
    a = {**dict(zip(names, args, strict=False)), **kwargs}
    if set(a) - set(names):
        return None
    return norm(imp, node, a.get("input"), a.get("normalized_shape"), a.get("weight"), None, a.get("eps"),
                     concrete, rms=True)

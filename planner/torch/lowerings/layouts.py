"""What several lowerings share: values settled into IR tensors, views and casts, and the layouts of attention's
heads and masks."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from planner.core.opaque import flat_shape
from planner.torch.binding import TORCH_DTYPES
from planner.torch.heads import head_split, rows_to_heads
from planner.torch.walk import (
    CHANNELS_LAST,
    Emitted,
    Importer,
    Traced,
    head_major_shape,
)


def settle(imp: Importer, v: Any) -> Any:
    """``v``, emitted now when it is a pending torch program that is an op-table layout op (``Heads``,
    ``RotateHalf``, ``Merge``): its consumer then sees the IR value and its layout."""
    if not (isinstance(v, Traced) and v.program is not None and v.dtype in TORCH_DTYPES):
        return v
    p = v.program
    if id(p) not in imp.emitted:
        layout = imp.layout_op(p, v)
        if layout is None:
            return v
        imp.emitted[id(p)] = layout
    return Traced(v.shape, v.dtype, v.runtime, imp.emitted[id(p)])


def tiles(imp: Importer, x: Any, t: Any, out: tuple[int, ...]) -> bool:
    """Does ``t`` broadcast over ``x`` (shape ``out``) as a tile of its trailing dimensions, leading ones 1,
    with the IR shapes of ``x`` ending in that tile (a head-major value: (batch * heads, seq, d)) and of ``t``
    being it (a constant, a call input or parameter, or a computed value: RoPE's cos and sin)?"""
    shape = tuple(t.shape)
    core = shape[next((i for i, d in enumerate(shape) if d != 1), len(shape)):]
    if len(core) < 2 or len(core) >= len(out) or out[len(out) - len(core):] != core or t.dtype not in TORCH_DTYPES:
        return False
    if any(d != 1 for d in shape[:len(shape) - len(core)]):
        return False
    if isinstance(t, Traced) and t.program is not None:
        return False  # a pending torch value: its layout is not known until it is emitted
    t_ir = imp.b.shape_of(t.id) if isinstance(t, Traced) and t.id is not None else flat_shape(shape)
    ir = imp.b.shape_of(x.id) if isinstance(x, Traced) and x.id is not None else None
    return ir is not None and len(ir) > len(core) and tuple(ir[len(ir) - len(core):]) == core == tuple(t_ir)


def alias(imp: Importer, x: Any, concrete: Any) -> Traced | None:
    """The same IR tensor seen with another torch shape (no node, no copy)."""
    if not isinstance(x, Traced) or not isinstance(concrete, torch.Tensor) or concrete.dtype != x.dtype:
        return None
    if x.layout == CHANNELS_LAST:
        assert x.id is not None
        if tuple(concrete.shape) == x.shape:
            return x
        if math.prod(x.shape[2:]) == 1 and flat_shape(concrete.shape) == imp.b.shape_of(x.id):
            return Traced(tuple(concrete.shape), x.dtype, x.runtime, x.id)  # one pixel: the rows are torch's order
        x = imp.plain(x)
    if flat_shape(concrete.shape) != flat_shape(x.shape):
        return None
    if x.program is not None and tuple(concrete.shape) == x.shape:
        return x  # contiguous(), clone(), .to(same dtype) of a pending torch-backed value: still pending
    if x.program is not None and x.dtype not in TORCH_DTYPES:
        return None  # indices computed by torch calls stay in them
    if x.program is not None:
        x = Traced(x.shape, x.dtype, x.runtime, imp.materialise(x))
    if x.id is None:
        if concrete.shape == x.shape:
            return Traced(tuple(concrete.shape), x.dtype, x.runtime, None, x.source, x.name)
        if x.source is None:
            return None
        # a call input or parameter seen with another shape (GPT-2's x.view(-1, d), its ids.view(-1, T)): bind
        # it, then alias
        return Traced(tuple(concrete.shape), x.dtype, x.runtime, imp.use(x, x.name or "view"))
    return Traced(tuple(concrete.shape), x.dtype, x.runtime, x.id)


def cast(imp: Importer, node: fx.Node, v: Any, dtype: torch.dtype) -> Traced | None:
    """Tensor value ``v`` as ``dtype``: itself, or the op-table Cast between float dtypes (``x.to(dtype)``, a
    binary op's operand as torch promotes it); None for anything else (integer indices stay torch's)."""
    if not isinstance(v, Traced) or v.dtype not in TORCH_DTYPES or dtype not in TORCH_DTYPES:
        return None
    if v.dtype == dtype:
        return v
    return imp.emit(node, "Cast", [imp.use(v, node.name)], {"dtype": TORCH_DTYPES[dtype]}, v.shape, dtype,
                     "_cast")


def affine(imp: Importer, node: fx.Node, x: Traced, a: float, b: float, concrete: torch.Tensor, suffix: str = "") -> Traced:
    if x.layout == CHANNELS_LAST:  # an elementwise op keeps the layout
        assert x.id is not None
        return imp.emit(node, "Affine", [x.id], {"a": float(a), "b": float(b)}, concrete.shape, concrete.dtype,
                        suffix, layout=CHANNELS_LAST)
    return imp.emit(node, "Affine", [imp.use(x, node.name)], {"a": float(a), "b": float(b)},
                     concrete.shape, concrete.dtype, suffix)


def head_major(imp: Importer, t: Traced) -> bool:
    """Is ``t`` (batch, heads, seq, d) in the op table's head-major layout: an IR value of shape
    (batch * heads, seq, d), or heads taken out of token rows still pending (``Heads`` once used; of token rows
    viewed as heads: ``Regroup`` then ``Heads``)?"""
    if t.program is not None:
        p = t.program
        taken = head_split(p.steps, p.in_shapes) is not None or rows_to_heads(p.steps, p.in_shapes)
        return taken and len(p.inputs) == 1 and imp.b.shape_of(p.inputs[0]) == flat_shape(p.in_shapes[0])
    return t.id is not None and imp.b.shape_of(t.id) == head_major_shape(t.shape)


def mask_layout(imp: Importer, mask: Any, scores: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, int, int] | None:
    """(mask value, the groups it holds, its rows) for an ``attn_mask`` the op table can add to ``scores``
    (batch, heads, S, T): shape (batches, 1, rows, T) after torch's left padding with 1s, batches 1 or the batch,
    or one per head (batch, heads, rows, T) (T5's position bias, ALiBi's slopes; batch 1 where the scores' is),
    rows 1 or S; float of the scores' dtype, or a constant bool mask, then 0 where kept and -inf elsewhere."""
    if not isinstance(mask, (Traced, torch.Tensor)) or len(mask.shape) > 4:
        return None
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, -math.inf)  # what torch's bool mask means
    if isinstance(mask, torch.Tensor) and bool(torch.isneginf(mask).all(-1).any()):
        return None  # a query row with no key: torch's attention gives it 0, a softmax of -inf scores NaN
    if mask.dtype != dtype or (isinstance(mask, Traced) and mask.program is not None):
        return None
    shape = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
    b, h, s, t = scores
    per_head = shape[1] == h != 1
    if (shape[1] != 1 and not per_head) or shape[3] != t or shape[2] not in (1, s):
        return None
    if shape[0] not in ((b,) if per_head and b != 1 else (1, b)):  # per head: the groups in the scores' order
        return None
    flat = (shape[0] * shape[1] * shape[2], t)
    if isinstance(mask, Traced) and mask.id is not None and imp.b.shape_of(mask.id) != flat:
        return None
    if isinstance(mask, torch.Tensor):
        mask = mask.reshape(flat)  # bound as the (groups * rows, T) the op reads
    elif flat_shape(mask.shape) != flat:
        return None
    return mask, shape[0] * shape[1], shape[2]


#: a float mask's value at most this masks a key as -inf does: added to a score it stays itself (|s| < 1e22),
#: and it leaves exp(m - max) = 0 beside a kept key
MASK_FLOOR = -1e30


def causal_mask(mask: Any, scores: tuple[int, ...]) -> bool:
    """Is ``mask`` a constant that masks exactly what ``is_causal`` does for scores (batch, heads, S, T), for
    every batch: the keys after each query's position (torch's top-left triangle) False, or a float at most
    :data:`MASK_FLOOR`, and every other key True, or 0?  Every query row keeps a key, so the two agree."""
    if not isinstance(mask, torch.Tensor) or not 2 <= mask.dim() <= 4:
        return False
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    b, _, s, t = scores
    if shape[1] != 1 or shape[2:] != (s, t) or shape[0] not in (1, b):
        return False
    keep = torch.ones(s, t, dtype=torch.bool).tril().expand(shape[0], s, t)
    m = mask.reshape(shape[0], s, t)
    if m.dtype == torch.bool:
        return bool(torch.equal(m, keep))
    return bool(torch.equal(m == 0, keep) and (m[~keep] <= MASK_FLOOR).all())


#: where a bool mask torch computes from the inputs is False its additive form holds this, not -inf: added to a
#: score (|s| < 2^39) it stays itself, and its exp after the row's maximum is subtracted is 0, as -inf's is; a row
#: of nothing else has a finite softmax, which :func:`computed_mask`'s ``kept`` then zeroes
MASKED = -(2.0**64)


def computed_mask(imp: Importer, node: fx.Node, mask: Traced, scores: tuple[int, ...], dtype: torch.dtype
                  ) -> tuple[Traced, str] | None:
    """(additive mask, kept) for a bool ``attn_mask`` torch computes from the call inputs (a padding mask built
    from an ``attention_mask`` of 0s and 1s) broadcast over the heads of ``scores`` (batch, heads, S, T): the
    mask as (batches, 1, S, T) of ``dtype``, 0 where True and :data:`MASKED` elsewhere (one Opaque node), and
    ``kept`` the IR id of (batch * heads, S, 1): 1 for a query row with a key to attend to, 0 for one without,
    whose attention torch makes 0.  Made once per mask and shape; None for another mask."""
    shape = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
    b, h, s, t = scores
    if len(mask.shape) > 4 or shape[1] != 1 or shape[3] != t or shape[0] not in (1, b) or shape[2] not in (1, s):
        return None
    assert mask.program is not None
    key = ("mask", id(mask.program), dtype, b * h)
    if key not in imp.derived:
        full = (shape[0], 1, s, t)
        wide = imp.then(mask, "torch.Tensor.expand", [list(full)], full, torch.bool) if tuple(mask.shape) != full else mask
        # the Opaque node's dtype is its inputs' (ids are carried as fp32): cast to the scores' where it differs
        added = imp.materialise(imp.then(wide, "torch.where", [0.0, MASKED], full, torch.float32))
        value = (Traced(full, dtype, True, added) if imp.b.dtype_of(added) == TORCH_DTYPES[dtype]
                 else imp.emit(node, "Cast", [added], {"dtype": TORCH_DTYPES[dtype]}, full, dtype, "_mask_cast"))
        top = imp.emit(node, "RowMax", [imp.use(value, f"{node.name}_mask")], None, (*full[:3], 1), dtype, "_mask_max")
        kept = imp.emit(node, "Affine", [top.id], {"a": -1.0 / MASKED, "b": 1.0}, (*full[:3], 1), dtype, "_kept")
        repeated = imp.emit(node, "GroupRepeat", [kept.id], {"heads": b * h // full[0], "rows": s}, (b, h, s, 1),
                            dtype, "_kept_heads")
        assert repeated.id is not None
        imp.derived[key] = (value, repeated.id)
    found: tuple[Traced, str] = imp.derived[key]
    return found


def masked_scores(imp: Importer, node: fx.Node, x: Any, mask: Any, out: tuple[int, ...], dtype: torch.dtype) -> Emitted | None:
    """``x + mask`` for head-major scores ``x`` (batch, heads, S, T) and an attention mask broadcast over the
    heads, or one per head: the mask repeated over the groups (``GroupRepeat``; once, a copy as groups, for one
    per head), then ``MaskAdd`` (``Add`` for one row per query).  None where ``x`` is no such value or the mask
    no such mask."""
    if not (isinstance(x, Traced) and x.id is not None and tuple(x.shape) == out
            and imp.b.shape_of(x.id) == head_major_shape(out)):
        return None
    layout = mask_layout(imp, mask, out, dtype)
    if layout is None:
        return None
    value, groups, rows = layout
    b, h = out[:2]
    repeated = imp.emit(node, "GroupRepeat", [imp.use(value, f"{node.name}_mask")],
                         {"heads": b * h // groups, "rows": rows}, (b, h, rows, out[-1]), dtype, "_mask")
    assert repeated.id is not None
    return imp.emit(node, "MaskAdd" if rows == 1 else "Add", [x.id, repeated.id], None, out, dtype)


def transposed_heads(imp: Importer, node: fx.Node, t: Traced) -> str | None:
    """The IR id of head-major keys when ``t`` is their ``transpose(-1, -2)`` still pending: of a head-major
    value, or of heads taken out of token rows in the same pending steps (then emitted as ``Heads``)."""
    p = t.program
    if p is None or len(p.inputs) != 1:
        return None
    step, n = p.steps[-1], len(p.steps)
    args = step.get("args")
    if (step.get("impl") not in ("torch.Tensor.transpose", "torch.transpose", "torch.ops.aten.transpose.int")
            or not isinstance(args, list) or len(args) != 3 or args[0] != ({"$in": 0} if n == 1 else {"$step": n - 2})
            or sorted(d % 4 for d in args[1:] if isinstance(d, int)) != [2, 3]):
        return None
    if n == 1:
        return p.inputs[0] if len(p.in_shapes[0]) == 4 and imp.b.shape_of(p.inputs[0]) == head_major_shape(p.in_shapes[0]) else None
    split = head_split(p.steps[:-1], p.in_shapes)
    if split is None or imp.b.shape_of(p.inputs[0]) != flat_shape(p.in_shapes[0]):
        return None
    layout = split[1]
    attrs = {"heads": layout.heads, "seq": layout.seq, "offset": layout.offset, "width": layout.width}
    shape = (t.shape[0], t.shape[1], t.shape[3], t.shape[2])  # the keys before their transpose
    return imp.emit(node, "Heads", [p.inputs[0]], attrs, shape, t.dtype, "_keys").id

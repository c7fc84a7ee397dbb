"""Attention's head layouts, read off the torch calls model code writes around ``scaled_dot_product_attention``.

Model code takes q, k and v head-major with ``split(d, dim=-1)[i]`` (or a projection of its own), ``view(b, s,
h, d // h)`` and ``transpose(1, 2)`` (or ``permute(0, 2, 1, 3)``), and merges the heads back with
``transpose(1, 2)`` and ``reshape(b, s, d)``.  The importer records such calls as Opaque steps; these
functions recognise the two layouts in a recorded step list, so that the importer emits the op table's
``Heads`` and ``Merge`` instead (``docs/torch.md``).  Qwen3 views the projection as heads first, normalises
each head's row, then transposes: the view is the op table's ``Regroup``, the transpose ``Regroup`` back to token
rows and ``Heads``.  RoPE's ``rotate_half`` (``cat((-x[..., d/2:],
x[..., :d/2]), dim=-1)``, slices and all) is recognised the same way, as the op table's ``RotateHalf``.
Anything else is not recognised and stays Opaque.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Shape = tuple[int, ...]

_SPLITS = frozenset({"torch.Tensor.split", "torch.split", "torch.ops.aten.split.Tensor"})
_CHUNKS = frozenset({"torch.Tensor.chunk", "torch.chunk", "torch.ops.aten.chunk.default"})
_VIEWS = frozenset({"torch.Tensor.view", "torch.Tensor.reshape", "torch.reshape", "torch.ops.aten.view.default",
                    "torch.ops.aten.reshape.default", "torch.ops.aten._unsafe_view.default",
                    "torch.Tensor.contiguous", "torch.ops.aten.contiguous.default"})
_TRANSPOSES = frozenset({"torch.Tensor.transpose", "torch.transpose", "torch.ops.aten.transpose.int"})
_PERMUTES = frozenset({"torch.Tensor.permute", "torch.permute", "torch.ops.aten.permute.default"})
_NEGS = frozenset({"torch.neg", "torch.negative", "torch.Tensor.neg", "torch.operator.neg", "torch.ops.aten.neg.default"})
_CATS = frozenset({"torch.cat", "torch.concat", "torch.concatenate", "torch.ops.aten.cat.default"})
_SLICES = frozenset({"torch.ops.aten.slice.Tensor"})
_GETITEM = "torch.operator.getitem"


@dataclass(frozen=True)
class HeadSplit:
    """Columns [offset, offset + width) of a (batch, seq, C) tensor as (batch, heads, seq, width / heads)."""

    heads: int
    seq: int
    offset: int
    width: int


def _args(step: dict[str, Any]) -> list[Any]:
    args = step.get("args")
    return args if isinstance(args, list) else []


def _kwargs(step: dict[str, Any]) -> dict[str, Any]:
    kw = step.get("kwargs")
    inner = kw.get("$dict") if isinstance(kw, dict) else None
    return inner if isinstance(inner, dict) else {}


def _reads(step: dict[str, Any], ref: dict[str, int]) -> bool:
    args = _args(step)
    return bool(args) and args[0] == ref


def _int_list(v: Any) -> list[int] | None:
    if isinstance(v, dict) and set(v) in ({"$list"}, {"$tuple"}):
        v = next(iter(v.values()))
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return list(v)
    return None


def _swaps_dims_1_2(step: dict[str, Any], rank: int) -> bool:
    impl, args = step.get("impl"), _args(step)
    if impl in _TRANSPOSES:
        dims = sorted(d % rank for d in args[1:3] if isinstance(d, int)) if len(args) == 3 else []
        return dims == [1, 2]
    if impl in _PERMUTES:
        perm = _int_list(args[1]) if len(args) == 2 else [a for a in args[1:] if isinstance(a, int)]
        return perm == [0, 2, 1, 3]
    return False


def _column_slice(step: dict[str, Any], in_shape: Shape) -> tuple[int, int] | None:
    """(offset, width) of a slice of the last dimension (``x[..., a:b]``, Phi-3's packed ``qkv[..., :d]``), or
    of a split or chunk of it, item ``step["item"]``."""
    sliced = _slice_of_last(step, len(in_shape), in_shape[-1])
    if sliced is not None:
        return sliced[0], sliced[1] - sliced[0]
    impl, args, kw, item = step.get("impl"), _args(step), _kwargs(step), step.get("item")
    dim = kw.get("dim", args[2] if len(args) > 2 else 0)
    if not isinstance(item, int) or item < 0 or not isinstance(dim, int) or dim % len(in_shape) != len(in_shape) - 1:
        return None
    cols = in_shape[-1]
    if impl in _SPLITS and len(args) >= 2:
        sizes = [args[1]] if isinstance(args[1], int) else _int_list(args[1])
        if not sizes or any(s <= 0 for s in sizes):
            return None
        if len(sizes) == 1:
            offset, width = item * sizes[0], min(sizes[0], cols - item * sizes[0])
        elif item < len(sizes):
            offset, width = sum(sizes[:item]), sizes[item]
        else:
            return None
    elif impl in _CHUNKS and len(args) >= 2 and isinstance(args[1], int) and args[1] > 0:
        size = -(-cols // args[1])
        offset, width = item * size, min(size, cols - item * size)
    else:
        return None
    return (offset, width) if width > 0 and offset + width <= cols else None


_CONTIGUOUS = frozenset({"torch.Tensor.contiguous", "torch.ops.aten.contiguous.default"})


def _without_trailing_copies(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``steps`` less the ``contiguous()`` calls that end them (each reading the step before: a head-major op
    result is contiguous already)."""
    rest = list(steps)
    while (len(rest) > 1 and rest[-1].get("impl") in _CONTIGUOUS and len(_args(rest[-1])) == 1
           and _reads(rest[-1], {"$step": len(rest) - 2}) and not _kwargs(rest[-1])):
        rest.pop()
    return rest


def head_split(steps: Sequence[dict[str, Any]], in_shapes: Sequence[Shape]) -> tuple[int, HeadSplit] | None:
    """(input index, layout) when ``steps`` take heads out of one input of shape (batch, seq, C): an optional
    split/chunk of the last dimension, a view to (batch, seq, heads, d) and a swap of dims 1 and 2 (then
    ``contiguous()``, as Whisper's attention writes it, or not)."""
    steps = _without_trailing_copies(steps)
    if len(in_shapes) != 1 or len(in_shapes[0]) != 3 or len(steps) not in (2, 3):
        return None
    b, s, c = in_shapes[0]
    offset, width = 0, c
    ref: dict[str, int] = {"$in": 0}
    rest = list(steps)
    if len(rest) == 3:
        first = rest.pop(0)
        sliced = _column_slice(first, in_shapes[0]) if _reads(first, ref) else None
        if sliced is None:
            return None
        offset, width = sliced
        ref = {"$step": 0}
    view, swap = rest
    out = view.get("out")
    if view.get("impl") not in _VIEWS or not _reads(view, ref) or not isinstance(out, list) or len(out) != 4:
        return None
    if out[:2] != [b, s] or out[2] * out[3] != width:
        return None
    if not _reads(swap, {"$step": len(steps) - 2}) or not _swaps_dims_1_2(swap, 4):
        return None
    if swap.get("out") != [b, out[2], s, out[3]]:
        return None
    return 0, HeadSplit(heads=out[2], seq=s, offset=offset, width=width)


def regrouped(steps: Sequence[dict[str, Any]], in_shapes: Sequence[Shape], out_shape: Shape) -> bool:
    """Do ``steps`` only view one input (``view``, ``reshape``, ``contiguous``) as rows of another length: the same
    elements in order (Qwen3's ``view(b, s, heads, d)`` of a projection that it normalises per head)?"""
    if len(in_shapes) != 1 or not steps or not in_shapes[0] or len(out_shape) < 2 or out_shape[-1] == in_shapes[0][-1]:
        return False  # a 1-D result is its own IR shape, not rows
    return all(step.get("impl") in _VIEWS and _reads(step, {"$in": 0} if i == 0 else {"$step": i - 1})
               for i, step in enumerate(steps))


def rows_to_heads(steps: Sequence[dict[str, Any]], in_shapes: Sequence[Shape]) -> bool:
    """Do ``steps`` swap dims 1 and 2 of one (batch, seq, heads, d) input (then ``contiguous()`` or not): heads
    taken out of token rows that were viewed as heads before (:func:`regrouped`)?"""
    steps = _without_trailing_copies(steps)
    if len(in_shapes) != 1 or len(in_shapes[0]) != 4 or len(steps) != 1:
        return False
    b, s, h, d = in_shapes[0]
    (swap,) = steps
    return _reads(swap, {"$in": 0}) and _swaps_dims_1_2(swap, 4) and swap.get("out") == [b, h, s, d]


def head_merge(steps: Sequence[dict[str, Any]], in_shapes: Sequence[Shape], out_shape: Shape) -> int | None:
    """The head count when ``steps`` merge (batch, heads, seq, d) back to (batch, seq, heads * d): a swap of
    dims 1 and 2, then views (``contiguous`` included) ending in that shape."""
    if len(in_shapes) != 1 or len(in_shapes[0]) != 4 or not steps:
        return None
    b, h, s, d = in_shapes[0]
    if tuple(out_shape) != (b, s, h * d) or not _reads(steps[0], {"$in": 0}) or not _swaps_dims_1_2(steps[0], 4):
        return None
    for i, step in enumerate(steps[1:], start=1):
        if step.get("impl") not in _VIEWS or not _reads(step, {"$step": i - 1}):
            return None
    return h


def column_take(steps: Sequence[dict[str, Any]], in_shapes: Sequence[Shape], out_shape: Shape) -> tuple[int, int] | None:
    """(offset, width) when ``steps`` are one take of columns of the last dimension of their one input (a chunk,
    split or slice: a packed projection taken apart), the other dimensions kept."""
    if len(steps) != 1 or len(in_shapes) != 1 or not in_shapes[0] or not _reads(steps[0], {"$in": 0}):
        return None
    taken = _column_slice(steps[0], in_shapes[0])
    if taken is None or tuple(out_shape) != (*in_shapes[0][:-1], taken[1]):
        return None
    return taken


# ---------------------------------------------------------------- RoPE's rotate_half


def takes_columns(step: dict[str, Any]) -> bool:
    """Might this step take columns of the last dimension (a slice, an index with slices, a split or chunk)?"""
    return step.get("impl") in _SLICES | _SPLITS | _CHUNKS | {_GETITEM}


def _bound(v: Any, cols: int, default: int) -> int | None:
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        return None
    return max(0, min(cols, v + cols if v < 0 else v))


def _slice_of_last(step: dict[str, Any], rank: int, cols: int) -> tuple[int, int] | None:
    """(start, stop) when the step is ``x[..., a:b]`` (or ``aten.slice`` of the last dim) with step 1."""
    impl, args, kw = step.get("impl"), _args(step), _kwargs(step)
    if impl in _SLICES:
        dim, start, end, stride = (kw.get(n, args[i] if len(args) > i else d)
                                   for i, (n, d) in enumerate((("dim", 0), ("start", None), ("end", None), ("step", 1)), 1))
    elif impl == _GETITEM and len(args) == 2 and isinstance(args[1], dict) and "$tuple" in args[1]:
        items = args[1]["$tuple"]
        full = {"$slice": [None, None, None]}
        lead, last = items[:-1], items[-1] if items else None
        if not (isinstance(last, dict) and "$slice" in last):
            return None
        if lead != [{"$ellipsis": 0}] and lead != [full] * (rank - 1):
            return None
        dim, (start, end, stride) = rank - 1, last["$slice"]
    else:
        return None
    if not isinstance(dim, int) or dim % rank != rank - 1 or stride not in (None, 1):
        return None
    a, b = _bound(start, cols, 0), _bound(end, cols, cols)
    return (a, b) if a is not None and b is not None and a < b else None


def _columns(steps: Sequence[dict[str, Any]], ref: Any, in_shape: Shape) -> tuple[int, int, int] | None:
    """(sign, start, stop): ``ref`` is columns [start, stop) of input 0, negated when sign is -1."""
    if ref == {"$in": 0}:
        return 1, 0, in_shape[-1]
    if not (isinstance(ref, dict) and isinstance(ref.get("$step"), int) and 0 <= ref["$step"] < len(steps)):
        return None
    step = steps[ref["$step"]]
    args = _args(step)
    if step.get("impl") in _NEGS and len(args) == 1:
        inner = _columns(steps, args[0], in_shape)
        return None if inner is None else (-inner[0], inner[1], inner[2])
    if not _reads(step, {"$in": 0}):
        return None
    sliced = _slice_of_last(step, len(in_shape), in_shape[-1])
    if sliced is None and step.get("impl") in _SPLITS | _CHUNKS:
        offset_width = _column_slice(step, in_shape)
        sliced = None if offset_width is None else (offset_width[0], offset_width[0] + offset_width[1])
    return None if sliced is None else (1, *sliced)


def rotate_half(steps: Sequence[dict[str, Any]], in_shapes: Sequence[Shape], out_shape: Shape) -> bool:
    """Do ``steps`` compute ``cat((-x[..., d/2:], x[..., :d/2]), dim=-1)`` of their one input ``x`` (RoPE's
    rotate_half, as LLaMA, Mistral, Qwen and GPT-NeoX write it)?"""
    if len(in_shapes) != 1 or not steps or tuple(in_shapes[0]) != tuple(out_shape) or not out_shape:
        return False
    cols, rank = out_shape[-1], len(out_shape)
    last = steps[-1]
    args, kw = _args(last), _kwargs(last)
    if last.get("impl") not in _CATS or not args:
        return False
    parts = args[0]["$tuple"] if isinstance(args[0], dict) and "$tuple" in args[0] else args[0]
    dim = kw.get("dim", args[1] if len(args) > 1 else 0)
    if not isinstance(parts, list) or len(parts) != 2 or not isinstance(dim, int) or dim % rank != rank - 1:
        return False
    half = cols // 2
    got = [_columns(steps, p, in_shapes[0]) for p in parts]
    return cols % 2 == 0 and got == [(-1, half, cols), (1, 0, half)]

"""The ops' shape rules: each checks its input shapes and gives its result's, and says what other inputs
an op may take given its first one (the property-test fuzzer and the op-table test draw examples with it).

A shape rule is called as ``rule(op_name, input_shapes, attrs) -> output shape`` and raises ``OpError``
naming the op when the inputs do not fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner.core.errors import OpError

Shape = tuple[int, ...]
Attrs = Mapping[str, Any]
CheckFn = Callable[[str, Sequence[Shape], Attrs], Shape]


@dataclass(frozen=True)
class ShapeRule:
    """An op's shape rule and, for examples, the shapes its other inputs take beside a first input of some
    shape (``operands(first)``: shapes for the further inputs, in order, of which an op takes as many as its
    arity asks; None where no valid example exists)."""

    check: CheckFn
    operands: Callable[[Shape], tuple[Shape, ...] | None]

    def __call__(self, op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
        return self.check(op, shapes, attrs)


def _same(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    first = shapes[0]
    for s in shapes[1:]:
        if s != first:
            raise OpError(f"{op}: input shapes differ: {list(first)} vs {list(s)}")
    return first


def _matmul(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    a, b = shapes
    if len(a) != 2 or len(b) != 2:
        raise OpError(f"{op}: expects 2-D inputs, got {list(a)} and {list(b)}")
    if a[1] != b[0]:
        raise OpError(f"{op}: inner dimensions differ: {list(a)} @ {list(b)}")
    return (a[0], b[1])


def _bias(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, bias = shapes
    if len(x) < 1 or len(bias) != 1 or bias[0] != x[-1]:
        raise OpError(
            f"{op}: bias must be 1-D with the input's last dimension, got {list(x)} + {list(bias)}"
        )
    return x


def _row(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    if len(x) < 1:
        raise OpError(f"{op}: reduces the last dimension of a tensor of rank >= 1, got a scalar")
    return (*x[:-1], 1)


def _tile(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, t = shapes
    if len(t) < 2 or len(x) <= len(t) or any(a != b for a, b in zip(x[len(x) - len(t):], t, strict=True)):
        raise OpError(f"{op}: the second input must be the trailing dimensions (two or more) of the first, "
                      f"broadcast over its leading ones, got {list(x)} and {list(t)}")
    return x


def _rotate_half(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    if not x or (isinstance(x[-1], int) and x[-1] % 2):  # symbolic dims (the rule checker's) have no parity
        raise OpError(f"{op}: rotates the two halves of an even last dimension, got {list(x)}")
    return x


def _per_row(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, r = shapes
    if len(r) != len(x) or len(x) < 1 or r[-1] != 1 or any(a != b for a, b in zip(x[:-1], r[:-1], strict=True)):
        raise OpError(f"{op}: the second input must be one value per row of the first (shape [..., 1]), "
                      f"got {list(x)} and {list(r)}")
    return x


def _per_image(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, s = shapes
    if len(x) == 2 == len(s) and not isinstance(x[0], int):  # the rule checker's symbolic dims: one image
        _ = s[0] == 1
    elif len(x) == 2 == len(s) and x[0] % s[0]:
        raise OpError(f"{op}: {x[0]} rows are not one image's pixels per row of {list(s)}")
    if len(x) != 2 or len(s) != 2 or s[1] != x[1]:
        raise OpError(f"{op}: the second input must be one row per image of the first's channels-last rows, (N, C) "
                      f"for (N*pixels, C), got {list(s)} for {list(x)}")
    return x


def _per_image_example(first: Shape) -> tuple[Shape, ...] | None:
    if len(first) != 2 or first[0] < 2:
        return None
    return ((first[0] // 2 if first[0] % 2 == 0 else 1, first[1]),)


def _heads(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    heads, seq, offset, width = (int(attrs[a]) for a in ("heads", "seq", "offset", "width"))
    if len(x) != 2 or x[0] % seq or offset + width > x[1] or width % heads:
        raise OpError(f"{op}: takes columns [{offset}, {offset + width}) of a 2-D tensor of rows (batch x {seq} "
                      f"tokens) as {heads} heads, got {list(x)}")
    return (x[0] // seq * heads, seq, width // heads)


def _columns(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    offset, width = int(attrs["offset"]), int(attrs["width"])
    if not x or offset + width > x[-1]:
        raise OpError(f"{op}: takes columns [{offset}, {offset + width}) of the last dimension, got {list(x)}")
    return (*x[:-1], width)


def _regroup(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    width, size = int(attrs["width"]), math.prod(x)
    if not x or size % width:
        raise OpError(f"{op}: takes rows of {width} elements from a tensor of a multiple of {width}, got {list(x)}")
    return (size // width, width)


def _embedding(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    ids, table = shapes
    if not ids or len(table) != 2:
        raise OpError(f"{op}: takes ids of rank >= 1 and a 2-D table, got {list(ids)} and {list(table)}")
    rows = 1
    for d in ids:
        rows *= d
    return (rows, table[1])


#: a window over the spatial dims of channels-last rows: (height, width, kernel h/w, stride h/w, padding h/w,
#: dilation h/w) (a 1-D one has height 1)
WINDOW = ("height", "width", "kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw")


def window_out(attrs: Attrs) -> tuple[int, int]:
    """The output height and width of a window (torch's floor rule, no ceil mode)."""
    h, w, kh, kw, sh, sw, ph, pw, dh, dw = (int(attrs[a]) for a in WINDOW)
    return (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1


def _windowed(op: str, x: Shape, attrs: Attrs, per_pixel: int) -> Shape:
    h, w = int(attrs["height"]), int(attrs["width"])
    oh, ow = window_out(attrs)
    if len(x) != 2 or x[0] % (h * w) or oh < 1 or ow < 1:
        raise OpError(f"{op}: takes channels-last rows (images x {h}x{w} pixels, channels) and a window that fits "
                      f"them, got {list(x)}")
    return (x[0] // (h * w) * oh * ow, x[1] * per_pixel)


def _im2col(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    return _windowed(op, x, attrs, int(attrs["kh"]) * int(attrs["kw"]))


def _pool(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    return _windowed(op, x, attrs, 1)


def _depthwise(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, w = shapes
    taps = int(attrs["kh"]) * int(attrs["kw"])
    if len(x) != 2 or tuple(w) != (taps, x[-1]):
        raise OpError(f"{op}: takes channels-last rows (pixels, C) and a weight of (kh*kw, C) = ({taps}, "
                      f"{x[-1] if len(x) == 2 else 'C'}), got {list(x)} and {list(w)}")
    return _windowed(op, x, attrs, 1)


def _spatial_mean(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    pixels = int(attrs["pixels"])
    if len(x) != 2 or x[0] % pixels:
        raise OpError(f"{op}: takes channels-last rows (images x {pixels} pixels, channels), got {list(x)}")
    return (x[0] // pixels, x[1])


def _channels_last(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    channels, pixels = int(attrs["channels"]), int(attrs["pixels"])
    total = 1
    for d in x:
        total *= d
    if len(x) != 2 or total % (channels * pixels):
        raise OpError(f"{op}: takes (images x {channels} channels x {pixels} pixels) in torch's order, got {list(x)}")
    return (total // channels, channels)


def _channels_first(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (x,) = shapes
    pixels, width = int(attrs["pixels"]), int(attrs["width"])
    if len(x) != 2 or x[0] % pixels or pixels % width:
        raise OpError(f"{op}: takes channels-last rows (images x {pixels} pixels, channels) of rows {width} wide, "
                      f"got {list(x)}")
    return (x[0] * x[1] // width, width)


def _merge(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (y,) = shapes
    heads = int(attrs["heads"])
    if len(y) != 3 or y[0] % heads:
        raise OpError(f"{op}: takes (batch x {heads} heads, tokens, head dim), got {list(y)}")
    return (y[0] // heads * y[1], heads * y[2])


def batch_shape(op: str, shapes: Sequence[Shape], transpose_b: bool) -> Shape:
    """A batched product's result: (G,S,K) times (G,K,N), or times (G,T,K) transposed."""
    a, b = shapes
    inner = b[2] if transpose_b else b[1]
    if len(a) != 3 or len(b) != 3 or a[0] != b[0] or a[2] != inner:
        rhs = "(G, T, K)" if transpose_b else "(G, K, N)"
        raise OpError(f"{op}: expects (G, S, K) and {rhs}, got {list(a)} and {list(b)}")
    return (a[0], a[1], b[1] if transpose_b else b[2])


def _mask(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x, m = shapes
    if len(x) != 3 or len(m) != 3 or m[0] != x[0] or m[1] != 1 or m[2] != x[2]:
        raise OpError(f"{op}: the mask must be one row of keys per group, (G, 1, T) for scores (G, S, T), "
                      f"got {list(m)} for {list(x)}")
    return x


def _attention(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    q, k, v = shapes[:3]
    scores = batch_shape(op, [q, k], True)
    if len(shapes) == 4:
        _mask(op, [scores, shapes[3]], attrs)
    return batch_shape(op, [scores, v], False)


def _biased_attention(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    q, k, v, bias = shapes
    scores = batch_shape(op, [q, k], True)
    if len(bias) != 3 or any(a != b for a, b in zip(bias, scores, strict=True)):
        raise OpError(f"{op}: the bias must be the scores' shape (G, S, T) = {list(scores)}, got {list(bias)}")
    return batch_shape(op, [scores, v], False)


def _group_repeat(op: str, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    (m,) = shapes
    heads, rows = int(attrs["heads"]), int(attrs["rows"])
    if len(m) == 3 and m[1] == rows:  # groups already: (kv heads, T, d) keys repeated for their query heads
        return (m[0] * heads, rows, m[2])
    if len(m) != 2 or m[0] % rows:
        raise OpError(f"{op}: takes (batch x {rows} rows, T) or (groups, {rows}, T), got {list(m)}")
    return (m[0] // rows * heads, rows, m[1])


def _no_example(first: Shape) -> None:
    return None


#: every input the same shape (an example gives as many further inputs as the op takes)
same_shape = ShapeRule(_same, lambda first: (first, first))
matmul_shape = ShapeRule(_matmul, lambda first: ((first[-1], 3),) if len(first) == 2 else None)
bias_shape = ShapeRule(_bias, lambda first: ((first[-1],),) if first else None)
row_shape = ShapeRule(_row, lambda first: () if first else None)
tile_shape = ShapeRule(_tile, lambda first: (first[1:],) if len(first) >= 3 else None)
rotate_half_shape = ShapeRule(_rotate_half, lambda first: () if first and first[-1] % 2 == 0 else None)
per_row_shape = ShapeRule(_per_row, lambda first: ((*first[:-1], 1),) if first else None)
per_image_shape = ShapeRule(_per_image, _per_image_example)
mask_shape = ShapeRule(_mask, lambda first: ((first[0], 1, first[2]),) if len(first) == 3 else None)
heads_shape = ShapeRule(_heads, _no_example)
merge_shape = ShapeRule(_merge, _no_example)
columns_shape = ShapeRule(_columns, _no_example)
regroup_shape = ShapeRule(_regroup, _no_example)
embedding_shape = ShapeRule(_embedding, _no_example)
im2col_shape = ShapeRule(_im2col, _no_example)
pool_shape = ShapeRule(_pool, _no_example)
depthwise_shape = ShapeRule(_depthwise, _no_example)
spatial_mean_shape = ShapeRule(_spatial_mean, _no_example)
channels_last_shape = ShapeRule(_channels_last, _no_example)
channels_first_shape = ShapeRule(_channels_first, _no_example)
attention_shape = ShapeRule(_attention, _no_example)
biased_attention_shape = ShapeRule(_biased_attention, _no_example)
group_repeat_shape = ShapeRule(_group_repeat, _no_example)


def batched_shape(transpose_b: bool) -> ShapeRule:
    return ShapeRule(lambda op, shapes, attrs: batch_shape(op, shapes, transpose_b), _no_example)


__all__ = ["WINDOW", "Attrs", "Shape", "ShapeRule", "attention_shape", "batch_shape", "batched_shape", "bias_shape",
           "biased_attention_shape", "channels_first_shape", "channels_last_shape", "columns_shape", "im2col_shape", "pool_shape",
           "regroup_shape", "spatial_mean_shape", "window_out", "embedding_shape", "group_repeat_shape", "heads_shape", "mask_shape", "matmul_shape", "merge_shape", "per_row_shape",
           "rotate_half_shape", "row_shape", "same_shape", "tile_shape"]

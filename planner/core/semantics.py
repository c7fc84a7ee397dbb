"""The ops' numpy semantics: what each op of the op table computes, in the working float type of the
reference executor (fp32 "registers" or fp64 for the oracle). Infinities and NaN are values, as in torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from planner.core.shapes import WINDOW, window_out

Attrs = Mapping[str, Any]


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = x.dtype.type(math.sqrt(2.0 / math.pi))
    return x.dtype.type(0.5) * x * (1 + np.tanh(c * (x + x.dtype.type(0.044715) * x * x * x)))


def erf(x: np.ndarray) -> np.ndarray:
    from scipy.special import erf  # imported on first use: it adds 0.4 s to every command's start

    return erf(x).astype(x.dtype)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    return x.dtype.type(0.5) * x * (1 + erf(x / x.dtype.type(math.sqrt(2.0))))


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-x))


def clamp(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    """torch.clamp: NaN stays NaN (numpy's maximum and minimum keep it too)."""
    y = x if attrs["sides"] == "max" else np.maximum(x, x.dtype.type(attrs["lo"]))
    return y if attrs["sides"] == "min" else np.minimum(y, x.dtype.type(attrs["hi"]))


def leaky_relu(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(x > 0, x, x * x.dtype.type(attrs["slope"]))


def _hard_gate(x: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(x + x.dtype.type(3), x.dtype.type(0)), x.dtype.type(6))


def hardswish(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return x * _hard_gate(x) / x.dtype.type(6)


def hardsigmoid(x: np.ndarray) -> np.ndarray:
    return _hard_gate(x) / x.dtype.type(6)


def affine(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    a, b = float(attrs["a"]), float(attrs["b"])
    y = x if a == 1.0 else x.dtype.type(a) * x
    return y if b == 0.0 else y + x.dtype.type(b)


def divide(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # ±inf and NaN are the values, as in torch
        return x / y


def heads(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    heads, seq, offset, width = (int(attrs[a]) for a in ("heads", "seq", "offset", "width"))
    cols = x[:, offset:offset + width].reshape(-1, seq, heads, width // heads)
    return np.ascontiguousarray(cols.transpose(0, 2, 1, 3)).reshape(-1, seq, width // heads)


def regroup(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1, int(attrs["width"]))


def columns(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    offset, width = int(attrs["offset"]), int(attrs["width"])
    return np.ascontiguousarray(x[..., offset:offset + width])


def table_rows(ids: np.ndarray, n_rows: int) -> np.ndarray:
    """The row numbers ids carried as floats name, flattened; an id that is not a whole row number below
    ``n_rows`` is an error (as torch's embedding raises)."""
    flat = ids.reshape(-1)
    with np.errstate(invalid="ignore"):  # a NaN id: refused below
        rows = flat.astype(np.intp)
    bad = (rows != flat) | (rows < 0) | (rows >= n_rows)
    if bad.any():
        first = float(flat[bad][0])
        shown = int(first) if first.is_integer() else first
        raise IndexError(f"Embedding: id {shown} is not a row of a table of {n_rows} rows (0 to {n_rows - 1})")
    return rows


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``table[ids]`` with ids flattened."""
    return table[table_rows(ids, table.shape[0])]


# ---------------------------------------------------------------- convolutions, channels last
# An image batch (N, C, H, W) in torch's order is stored channels last as (N*H*W, C) rows: a convolution is
# its window's pixels side by side (Im2col) times the weight, a GEMM with the GEMM's epilogues.


def _window(attrs: Attrs) -> tuple[int, ...]:
    return tuple(int(attrs[a]) for a in WINDOW)


def _taps(attrs: Attrs) -> Iterator[tuple[int, int, slice, slice, slice, slice]]:
    """For each kernel tap (i, j): the output rows and columns it reaches inside the image, and the input
    rows and columns they read (strided slices): the padding is what no tap reaches."""
    h, w, kh, kw, sh, sw, ph, pw, dh, dw = _window(attrs)
    oh, ow = window_out(attrs)

    def span(tap: int, size: int, stride: int, pad: int, out: int) -> tuple[slice, slice] | None:
        first = max(0, -(-(pad - tap) // stride))  # the first output whose input index is >= 0
        last = min(out - 1, (size - 1 + pad - tap) // stride)
        if last < first:
            return None
        start = first * stride - pad + tap
        return slice(first, last + 1), slice(start, start + (last - first) * stride + 1, stride)

    for i in range(kh):
        rows = span(i * dh, h, sh, ph, oh)
        for j in range(kw):
            cols = span(j * dw, w, sw, pw, ow)
            if rows is not None and cols is not None:
                yield i, j, rows[0], cols[0], rows[1], cols[1]


def im2col(x: np.ndarray, attrs: Attrs, out: np.ndarray | None = None) -> np.ndarray:
    """Each output pixel's window of channels-last rows side by side, (kh, kw, C) per row; 0 in the padding."""
    h, w, kh, kw, *_ = _window(attrs)
    c = x.shape[-1]
    images = x.reshape(-1, h, w, c)
    oh, ow = window_out(attrs)
    if out is None:
        out = np.empty((images.shape[0] * oh * ow, kh * kw * c), x.dtype)
    cells = out.reshape(images.shape[0], oh, ow, kh, kw, c)
    cells[...] = 0
    for i, j, orows, ocols, irows, icols in _taps(attrs):
        cells[:, orows, ocols, i, j, :] = images[:, irows, icols, :]
    return out


def depthwise_conv(x: np.ndarray, w: np.ndarray, attrs: Attrs) -> np.ndarray:
    """Each channel of channels-last rows convolved with its own (kh, kw) taps (a weight of (kh*kw, C)): torch's
    conv2d with groups = channels; 0 in the padding, the taps summed in order."""
    h, w_, kh, kw, *_ = _window(attrs)
    c = x.shape[-1]
    images = x.reshape(-1, h, w_, c)
    oh, ow = window_out(attrs)
    out = np.zeros((images.shape[0], oh, ow, c), x.dtype)
    for i, j, orows, ocols, irows, icols in _taps(attrs):
        out[:, orows, ocols, :] += images[:, irows, icols, :] * w[i * kw + j]
    return out.reshape(-1, c)


def per_image(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """``fn`` of channels-last rows (N*pixels, C) and one row per image (N, C), each image's row over its pixels."""

    def call(x: np.ndarray, s: np.ndarray) -> np.ndarray:
        images = s.shape[0]
        return fn(x.reshape(images, -1, x.shape[-1]), s[:, None, :]).reshape(x.shape)

    return call


def avg_pool(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    """The mean of each window of channels-last rows (0 in the padding), divided by ``divisor`` where it is set,
    else by the window's size (``include_pad``) or by its pixels inside the image (torch's avg_pool2d)."""
    h, w, kh, kw, *_ = _window(attrs)
    c = x.shape[-1]
    images = x.reshape(-1, h, w, c)
    oh, ow = window_out(attrs)
    total = np.zeros((images.shape[0], oh, ow, c), np.float64)
    inside = np.zeros((oh, ow), np.int64)
    for _, _, orows, ocols, irows, icols in _taps(attrs):
        total[:, orows, ocols, :] += images[:, irows, icols, :]
        inside[orows, ocols] += 1
    divisor = int(attrs["divisor"]) or (kh * kw if attrs["include_pad"] else inside[None, :, :, None])
    return (total / divisor).astype(x.dtype).reshape(-1, c)


def max_pool(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    """The largest value of each window of channels-last rows (padding is -inf, as torch pads it)."""
    h, w, *_ = _window(attrs)
    c = x.shape[-1]
    images = x.reshape(-1, h, w, c)
    oh, ow = window_out(attrs)
    out = np.full((images.shape[0], oh, ow, c), -np.inf, x.dtype)
    for _, _, orows, ocols, irows, icols in _taps(attrs):
        out[:, orows, ocols, :] = np.maximum(out[:, orows, ocols, :], images[:, irows, icols, :])
    return out.reshape(-1, c)


def spatial_mean(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    """The mean over each image's pixels of channels-last rows (adaptive average pooling to 1x1)."""
    pixels = int(attrs["pixels"])
    return np.mean(x.reshape(-1, pixels, x.shape[-1]), axis=1, dtype=np.float64).astype(x.dtype)


def channels_last(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    """(N, C, pixels) in torch's order as (N*pixels, C) rows."""
    c, pixels = int(attrs["channels"]), int(attrs["pixels"])
    return np.ascontiguousarray(x.reshape(-1, c, pixels).transpose(0, 2, 1)).reshape(-1, c)


def channels_first(x: np.ndarray, attrs: Attrs) -> np.ndarray:
    """(N*pixels, C) rows back in torch's (N, C, pixels) order, as rows of the image's width."""
    pixels, width = int(attrs["pixels"]), int(attrs["width"])
    c = x.shape[-1]
    return np.ascontiguousarray(x.reshape(-1, pixels, c).transpose(0, 2, 1)).reshape(-1, width)


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def merge(y: np.ndarray, attrs: Attrs) -> np.ndarray:
    heads = int(attrs["heads"])
    g, s, d = y.shape
    return np.ascontiguousarray(y.reshape(g // heads, heads, s, d).transpose(0, 2, 1, 3)).reshape(-1, heads * d)


def causal(scores: np.ndarray) -> np.ndarray:
    """Scores with query i's keys after i set to -inf (torch's ``is_causal``: the top-left triangle kept)."""
    s, t = scores.shape[-2:]
    return np.where(np.triu(np.ones((s, t), dtype=bool), 1), scores.dtype.type(-np.inf), scores)


def batch_scores(q: np.ndarray, k: np.ndarray, attrs: Attrs) -> np.ndarray:
    scores = np.matmul(q, np.swapaxes(k, -1, -2))
    return causal(scores) if attrs["causal"] else scores


def group_repeat(m: np.ndarray, attrs: Attrs) -> np.ndarray:
    heads, rows = int(attrs["heads"]), int(attrs["rows"])
    cols = m.shape[-1]
    b = m.size // (rows * cols)
    return np.ascontiguousarray(np.broadcast_to(m.reshape(b, 1, rows, cols), (b, heads, rows, cols))).reshape(
        b * heads, rows, cols)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, attrs: Attrs, mask: np.ndarray | None = None) -> np.ndarray:
    s = affine(batch_scores(q, k, attrs), {"a": attrs["scale"], "b": 0.0})
    if mask is not None:
        s = s + mask
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(s - np.max(s, axis=-1, keepdims=True))
        return np.matmul(e / np.sum(e, axis=-1, keepdims=True), v)


def row_mean(x: np.ndarray) -> np.ndarray:
    return np.sum(x, axis=-1, keepdims=True) / x.dtype.type(x.shape[-1])


def quiet(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """numpy's function with its overflow/invalid warnings off: inf and NaN are the values, as in torch."""

    def call(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return fn(x)

    return call

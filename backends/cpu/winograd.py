"""Winograd's minimal filtering F(4x4, 3x3) for fp32 3x3 convolutions of stride and dilation 1 (Lavin and Gray,
*Fast Algorithms for Convolutional Neural Networks*, 2016): each 4x4 block of outputs from a 6x6 block of inputs
in 36 products where the direct form takes 144, so the product's multiply-adds drop 4x.

The convolution is three steps over channels-last rows ``x`` (N*H*W, C) and the GEMM's weight ``w`` (9*C, O):

1. the input transform ``V = Bᵀ d B`` of every 6x6 input tile ``d`` (tiles 4 pixels apart, padding read as 0),
   a generated kernel writing ``V`` as 36 matrices (tiles, C);
2. 36 products ``M[ij] = V[ij] @ U[ij]`` in one batched product (torch's, on the plan's threads), where
   ``U = G g Gᵀ`` is the weight's transform (36, C, O), computed once per read-only weight in fp64;
3. the output transform ``Y = Aᵀ m A`` of each tile's 36 products, a generated kernel writing the product rows
   (N*OH*OW, O) that the kernel's generated epilogue (bias, residual, activation) then reads.

The transforms round more than the direct product does: their results were 3-6x further from the exact
convolution than oneDNN's (fp32, 64-512 channels), a fifth to a quarter of fp32's tolerance, which every candidate
is checked against; never used for a 16-bit dtype.  Where it is used is measured (:func:`measured_convolution`), as is torch's fp32 attention."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from backends.cpu import parallel
from backends.cpu.buffers import aligned_empty
from backends.cpu.compiler import cache_dir, keep_record, read_record
from backends.cpu.prelude import PRELUDE, SYMBOL
from planner.core.env import env_choice
from planner.core.machine import cpu_model
from planner.core.shapes import WINDOW, window_out

log = logging.getLogger(__name__)

#: output tile side m and input tile side m + 2 of F(m x m, 3x3)
TILE, ALPHA = 4, 6
#: F(4, 3)'s transforms from the interpolation points 0, 1, -1, 2, -1/2 and infinity: input Bᵀ, filter G, output
#: Aᵀ.  Lavin and Gray's points 0, ±1, ±2 have larger constants (5, 8, 1/24), and their results came out 2-3x
#: further from the exact convolution (fp32, 64-512 channels; Barabasz et al., *Error analysis and improving the
#: accuracy of Winograd convolution*, 2020, compare point sets).  ``tests/backends/cpu/test_winograd.py`` proves
#: the identity ``Aᵀ[(G g) ⊙ (Bᵀ d)] = g ⋆ d`` exactly.
B_T = np.array([[1, 3 / 2, -2, -3 / 2, 1, 0], [0, -1, -5 / 2, -1 / 2, 1, 0], [0, 1, 1 / 2, -5 / 2, 1, 0],
                [0, -1 / 2, -1, 1 / 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 1, 3 / 2, -2, -3 / 2, 1]], dtype=np.float64)
G = np.array([[1, 0, 0], [-1 / 3, -1 / 3, -1 / 3], [1 / 3, -1 / 3, 1 / 3], [1 / 15, 2 / 15, 4 / 15],
              [-16 / 15, 8 / 15, -4 / 15], [0, 0, 1]], dtype=np.float64)
A_T = np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -1 / 2, 0], [0, 1, 1, 4, 1 / 4, 0], [0, 1, -1, 8, -1 / 8, 1]],
               dtype=np.float64)
#: channels each step of a transform carries as one vector (16 lanes of AVX-512; two AVX2 vectors)
LANES = 16

#: which product computes an fp32 3x3 convolution: ``auto`` (the default) the faster of oneDNN's and Winograd's,
#: measured once per machine, torch version, shape and thread count; ``onednn`` or ``winograd`` force one
CONVOLUTION_ENV = "FUSION_PLANNER_CPU_CONVOLUTION"
CONVOLUTION_KERNELS = ("onednn", "winograd")
#: Winograd must be this much faster than oneDNN to replace it: the measurement's noise
WINOGRAD_MARGIN = 0.05
#: the smallest channel counts where Winograd is timed at all: with fewer, the transforms' memory traffic
#: outweighs the product it saves
MIN_CHANNELS = 16

Convolution = Callable[[np.ndarray, np.ndarray], np.ndarray]


def applies(window: Mapping[str, Any], channels: int, outputs: int, dtype: str) -> bool:
    """Can Winograd's F(4x4, 3x3) compute this convolution: fp32, a 3x3 window of stride and dilation 1, padding
    of at most 2 (a tile reads no further outside the image), channels in and out at least :data:`MIN_CHANNELS`?"""
    kh, kw, sh, sw, ph, pw, dh, dw = (int(window[a]) for a in ("kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw"))
    return (dtype == "fp32" and (kh, kw, sh, sw, dh, dw) == (3, 3, 1, 1, 1, 1) and ph <= 2 and pw <= 2
            and min(channels, outputs) >= MIN_CHANNELS)


def weight_transform(w: np.ndarray, channels: int) -> np.ndarray:
    """``U = G g Gᵀ`` of the GEMM weight ``w`` (3*3*C, O) (rows ordered kh, kw, c, as Im2col's columns), as 36
    (C, O) matrices, computed in fp64 and rounded once."""
    g = np.asarray(w, dtype=np.float64).reshape(3, 3, channels, -1)
    u = np.einsum("ia,jb,abco->ijco", G, G, g, optimize=True)
    return np.ascontiguousarray(u.reshape(ALPHA * ALPHA, channels, -1), dtype=np.float32)


def _combine(coefficients: np.ndarray, values: list[str]) -> list[str]:
    """C expressions of ``coefficients @ values``, zero terms left out, unit ones without a product."""
    out = []
    for row in coefficients:
        terms = []
        for c, v in zip(row, values, strict=True):
            if c == 0:
                continue
            mag = abs(float(c))
            term = v if mag == 1 else f"{float(np.float32(mag))!r}f * {v}"
            terms.append(("- " if c < 0 else "+ ") + term)
        expr = " ".join(terms)
        out.append(expr[2:] if expr.startswith("+ ") else "-" + expr[2:] if expr.startswith("- ") else expr)
    return out


def _geometry(window: Mapping[str, Any], images: int) -> dict[str, int]:
    h, w = int(window["height"]), int(window["width"])
    oh, ow = window_out(window)
    th, tw = -(-oh // TILE), -(-ow // TILE)
    return {"H": h, "W": w, "PH": int(window["ph"]), "PW": int(window["pw"]), "OH": oh, "OW": ow,
            "TH": th, "TW": tw, "T": images * th * tw}


def _defines(geometry: Mapping[str, int], channels: int) -> str:
    lines = [f"#define FP_{k} {v}" for k, v in geometry.items()]
    return "\n".join([*lines, f"#define FP_C {channels}", f"#define FP_L {LANES}", ""])


def input_source(window: Mapping[str, Any], images: int, channels: int) -> str:
    """C for the input transform of tiles [r0, r1): ``v[ij][t][c]`` (36 matrices of T rows of C) of the
    channels-last rows ``x``; a pixel outside the image reads as 0."""
    d = [f"d[{a}][j][k]" for a in range(ALPHA)]
    cols = _combine(B_T, d)
    rows = _combine(B_T, [f"s[i][{b}][k]" for b in range(ALPHA)])
    return PRELUDE + _defines(_geometry(window, images), channels) + f"""
static inline __attribute__((always_inline)) void fp_input_block(
        const float* restrict x, float* restrict v, int64_t t, int64_t y0, int64_t x0, int64_t n, int c0, const int nl) {{
    float d[6][6][FP_L], s[6][6][FP_L];
    for (int i = 0; i < 6; ++i) {{
        const int64_t yy = y0 + i;
        for (int j = 0; j < 6; ++j) {{
            const int64_t xx = x0 + j;
            if (yy >= 0 && yy < FP_H && xx >= 0 && xx < FP_W) {{
                const float* p = x + ((n * FP_H + yy) * FP_W + xx) * FP_C + c0;
                for (int k = 0; k < nl; ++k) d[i][j][k] = p[k];
            }} else {{
                for (int k = 0; k < nl; ++k) d[i][j][k] = 0.0f;
            }}
        }}
    }}
    for (int j = 0; j < 6; ++j)
        for (int k = 0; k < nl; ++k) {{
{_assign("s[{}][j][k]", cols, 12)}
        }}
    for (int i = 0; i < 6; ++i)
        for (int k = 0; k < nl; ++k) {{
{_assign("v[((int64_t)(i * 6 + {}) * FP_T + t) * FP_C + c0 + k]", rows, 12)}
        }}
}}

void {SYMBOL}(const float* restrict x, float* restrict v, int64_t r0, int64_t r1, int64_t unused) {{
    (void)unused;
    for (int64_t t = r0; t < r1; ++t) {{
        const int64_t n = t / (FP_TH * FP_TW), rest = t % (FP_TH * FP_TW);
        const int64_t y0 = (rest / FP_TW) * 4 - FP_PH, x0 = (rest % FP_TW) * 4 - FP_PW;
        int c0 = 0;
        for (; c0 + FP_L <= FP_C; c0 += FP_L) fp_input_block(x, v, t, y0, x0, n, c0, FP_L);
        if (c0 < FP_C) fp_input_block(x, v, t, y0, x0, n, c0, FP_C % FP_L);
    }}
}}
"""


def output_source(window: Mapping[str, Any], images: int, outputs: int) -> str:
    """C for the output transform of tiles [r0, r1): each tile's 4x4 outputs ``Aᵀ m A`` of its 36 products
    ``m[ij][t][o]``, written to the product rows ``y`` (N*OH*OW, O) inside the image."""
    cols = _combine(A_T, [f"m[((int64_t)({a} * 6 + j) * FP_T + t) * FP_C + c0 + k]" for a in range(ALPHA)])
    rows = _combine(A_T, [f"s[{b}][k]" for b in range(ALPHA)])
    return PRELUDE + _defines(_geometry(window, images), outputs) + f"""
static inline __attribute__((always_inline)) void fp_output_block(
        const float* restrict m, float* restrict y, int64_t t, int64_t oy, int64_t ox, int64_t n, int c0, const int nl) {{
    float a[4][6][FP_L];
    for (int j = 0; j < 6; ++j)
        for (int k = 0; k < nl; ++k) {{
{_assign("a[{}][j][k]", cols, 12)}
        }}
    for (int i = 0; i < 4; ++i) {{
        if (oy + i >= FP_OH) break;
        const float (*s)[FP_L] = a[i];
        float r[4][FP_L];
        for (int k = 0; k < nl; ++k) {{
{_assign("r[{}][k]", rows, 12)}
        }}
        for (int j = 0; j < 4 && ox + j < FP_OW; ++j) {{
            float* q = y + ((n * FP_OH + oy + i) * FP_OW + ox + j) * FP_C + c0;
            for (int k = 0; k < nl; ++k) q[k] = r[j][k];
        }}
    }}
}}

void {SYMBOL}(const float* restrict m, float* restrict y, int64_t r0, int64_t r1, int64_t unused) {{
    (void)unused;
    for (int64_t t = r0; t < r1; ++t) {{
        const int64_t n = t / (FP_TH * FP_TW), rest = t % (FP_TH * FP_TW);
        const int64_t oy = (rest / FP_TW) * 4, ox = (rest % FP_TW) * 4;
        int c0 = 0;
        for (; c0 + FP_L <= FP_C; c0 += FP_L) fp_output_block(m, y, t, oy, ox, n, c0, FP_L);
        if (c0 < FP_C) fp_output_block(m, y, t, oy, ox, n, c0, FP_C % FP_L);
    }}
}}
"""


def _assign(target: str, exprs: list[str], indent: int) -> str:
    pad = " " * indent
    return "\n".join(f"{pad}{target.format(i)} = {e};" for i, e in enumerate(exprs))


def sources(window: Mapping[str, Any], images: int, channels: int, outputs: int) -> tuple[str, str]:
    """The input and output transforms' C (what :func:`winograd_conv` compiles)."""
    return input_source(window, images, channels), output_source(window, images, outputs)


def winograd_conv(window: Mapping[str, Any], images: int, channels: int, outputs: int,
                  function: Callable[[str, int], Any], pool: parallel.WorkerPool, threads: int) -> Convolution:
    """``conv(x, w)``: the product ``Im2col(x) @ w`` of channels-last rows x (N*H*W, C) and the GEMM weight w
    (9*C, O) by F(4x4, 3x3), as rows (N*OH*OW, O) in an array of its own (reused by the next call: the caller
    reads it before then).  ``function(source, pointers)``: a compiled kernel.  The transforms' tiles are split
    across ``pool``; the batched product runs on torch's threads.  The weight's transform is kept while the
    weight is the same read-only array (a bound parameter)."""
    import torch  # optional dependency

    geometry = _geometry(window, images)
    tiles, cells = geometry["T"], ALPHA * ALPHA
    in_src, out_src = sources(window, images, channels, outputs)
    transform_in, transform_out = function(in_src, 2), function(out_src, 2)
    v = aligned_empty((cells, tiles, channels), np.float32)
    m = aligned_empty((cells, tiles, outputs), np.float32)
    y = aligned_empty((images * geometry["OH"] * geometry["OW"], outputs), np.float32)
    vt, mt = torch.from_numpy(v), torch.from_numpy(m)
    ranges = parallel.split(tiles, threads)
    kept: list[tuple[np.ndarray, Any] | None] = [None]

    def transformed(w: np.ndarray) -> Any:
        hit = kept[0]
        if hit is not None and hit[0] is w:
            return hit[1]
        u = torch.from_numpy(weight_transform(w, channels))
        if not w.flags.writeable:
            kept[0] = (w, u)
        return u

    def conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        u = transformed(w)
        pool.run_kernel(transform_in, 2, [[x.ctypes.data, v.ctypes.data, r0, r1, 0] for r0, r1 in ranges])
        torch.bmm(vt, u, out=mt)
        pool.run_kernel(transform_out, 2, [[m.ctypes.data, y.ctypes.data, r0, r1, 0] for r0, r1 in ranges])
        return y

    return conv


def measured_convolution(window: Mapping[str, Any], images: int, channels: int, outputs: int, threads: int,
                         measure: Callable[[], Mapping[str, float]]) -> str:
    """``onednn`` or ``winograd``: which product computes this fp32 3x3 convolution on ``threads`` threads
    (:data:`CONVOLUTION_ENV`).  ``auto`` takes the choice recorded in the kernel cache for this CPU, torch's
    version, shape and threads, else times both (``measure()``: seconds per product) and takes Winograd's only
    where it is :data:`WINOGRAD_MARGIN` faster."""
    value = env_choice(CONVOLUTION_ENV, ("auto", *CONVOLUTION_KERNELS), "auto")
    if value != "auto":
        return value
    import torch  # optional dependency (auto measures only where it is loaded)

    key = {"cpu": cpu_model(), "torch": torch.__version__, "window": {a: int(window[a]) for a in WINDOW},
           "images": images, "channels": channels, "outputs": outputs, "threads": threads}
    path = cache_dir() / f"convolution-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    record = read_record(path, key)
    if record is not None and record.get("choice") in CONVOLUTION_KERNELS:
        return str(record["choice"])
    seconds = dict(measure())
    choice = "winograd" if seconds["winograd"] * (1 + WINOGRAD_MARGIN) < seconds["onednn"] else "onednn"
    log.info("fp32 3x3 convolution %s, %d images, %d -> %d channels on %d thread(s): %s (oneDNN %.2f ms, "
             "Winograd %.2f ms)", geometry_text(window), images, channels, outputs, threads, choice,
             seconds["onednn"] * 1e3, seconds["winograd"] * 1e3)
    keep_record(path, {"key": key, "choice": choice, "seconds": seconds}, "the convolution kernel choice")
    return choice


def geometry_text(window: Mapping[str, Any]) -> str:
    return f"{int(window['height'])}x{int(window['width'])} padding {int(window['ph'])},{int(window['pw'])}"

"""Winograd's minimal filtering F(4x4, 3x3) for 3x3 convolutions of stride and dilation 1 (Lavin and Gray, *Fast
Algorithms for Convolutional Neural Networks*, 2016): each 4x4 block of outputs from a 6x6 block of inputs in 36
products where the direct form takes 144, so the product's multiply-adds drop 4x.

The convolution is three steps over channels-last rows ``x`` (N*H*W, C) and the GEMM's weight ``w`` (9*C, O),
block of tiles by block of tiles:

1. the input transform ``V = Bᵀ d B`` of every 6x6 input tile ``d`` (tiles 4 pixels apart, padding read as 0),
   a generated kernel writing ``V`` as 36 matrices (tiles, C);
2. 36 products ``M[ij] = V[ij] @ U[ij]`` in one batched product (torch's, on the plan's threads), where
   ``U = G g Gᵀ`` is the weight's transform (36, C, O), computed once per read-only weight in fp64;
3. the output transform ``Y = Aᵀ m A`` of each tile's 36 products, a generated kernel writing the product rows
   (N*OH*OW, O) that the kernel's generated epilogue (bias, residual, activation) then reads.

The transforms round more than the direct product does: fp32 results used 0.13-0.21 of fp32's tolerance against
the exact convolution, oneDNN's 0.02-0.07 (``docs/results/conv_kernels_amd.md``), and every candidate is checked
against that tolerance.  A 16-bit convolution (bf16, fp16) is transformed and multiplied in fp32 from its stored
values: closer to the exact convolution than oneDNN's 16-bit product, and its epilogue reads the fp32 product.
Where it is used is measured (:func:`measured_convolution`), as is torch's fp32 attention."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from backends.cpu import parallel
from backends.cpu.buffers import aligned_empty
from backends.cpu.codegen import storage_forms
from backends.cpu.compiler import recorded_choice
from backends.cpu.memory import cache_levels, from_storage
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
#: accuracy of Winograd convolution*, 2020, compare point sets).  ``tests/backends/test_cpu_winograd.py`` proves
#: the identity ``Aᵀ[(G g) ⊙ (Bᵀ d)] = g ⋆ d`` exactly.
B_T = np.array([[1, 3 / 2, -2, -3 / 2, 1, 0], [0, -1, -5 / 2, -1 / 2, 1, 0], [0, 1, 1 / 2, -5 / 2, 1, 0],
                [0, -1 / 2, -1, 1 / 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 1, 3 / 2, -2, -3 / 2, 1]], dtype=np.float64)
G = np.array([[1, 0, 0], [-1 / 3, -1 / 3, -1 / 3], [1 / 3, -1 / 3, 1 / 3], [1 / 15, 2 / 15, 4 / 15],
              [-16 / 15, 8 / 15, -4 / 15], [0, 0, 1]], dtype=np.float64)
A_T = np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -1 / 2, 0], [0, 1, 1, 4, 1 / 4, 0], [0, 1, -1, 8, -1 / 8, 1]],
               dtype=np.float64)
#: channels each step of a transform carries as one vector (16 lanes of AVX-512; two AVX2 vectors)
LANES = 16

#: which product computes a 3x3 convolution of stride 1: ``auto`` (the default) the faster of oneDNN's and
#: Winograd's, measured once per machine, torch version, shape, dtype and thread count; ``onednn`` or ``winograd``
#: force one
CONVOLUTION_ENV = "FUSION_PLANNER_CPU_CONVOLUTION"
CONVOLUTION_KERNELS = ("onednn", "winograd")
#: Winograd must be this much faster than oneDNN to replace it: the measurement's noise
WINOGRAD_MARGIN = 0.05
#: a block's bytes where the CPU reports no L2 (:func:`block_tiles`), and its fewest tiles: on one Zen 4 core
#: (1 MiB L2), 64 channels of 56x56 took 1.07 ms warm and 1.41 with the caches evicted in blocks of 49 tiles,
#: 1.20 and 1.48 in one block of 196, 1.19 and 1.45 in blocks of 14; 256 channels of 14x14 1.44 and 2.04 in one
#: block of 16 tiles, 1.67 and 2.44 in blocks of 8; on both cores, 64 channels of 56x56 took 0.79 and 1.34 ms in
#: one block, 1.12 and 1.65 in blocks of 49
DEFAULT_BLOCK_BYTES = 1 << 20
MIN_BLOCK = 16
#: the smallest channel counts where Winograd is timed at all: with fewer, the transforms' memory traffic
#: outweighs the product it saves
MIN_CHANNELS = 16

Convolution = Callable[[np.ndarray, np.ndarray], np.ndarray]


def applies(window: Mapping[str, Any], channels: int, outputs: int) -> bool:
    """Can Winograd's F(4x4, 3x3) compute this convolution: a 3x3 window of stride and dilation 1, padding of at
    most 2 (a tile reads no further outside the image), channels in and out at least :data:`MIN_CHANNELS`?"""
    kh, kw, sh, sw, ph, pw, dh, dw = (int(window[a]) for a in ("kh", "kw", "sh", "sw", "ph", "pw", "dh", "dw"))
    return (kh, kw, sh, sw, dh, dw) == (3, 3, 1, 1, 1, 1) and ph <= 2 and pw <= 2 and min(channels, outputs) >= MIN_CHANNELS


def weight_transform(w: np.ndarray, channels: int, dtype: str = "fp32") -> np.ndarray:
    """``U = G g Gᵀ`` of the GEMM weight ``w`` (3*3*C, O) stored as ``dtype`` (rows ordered kh, kw, c, as Im2col's
    columns), as 36 fp32 (C, O) matrices, computed in fp64 and rounded once."""
    g = from_storage(w, dtype).astype(np.float64).reshape(3, 3, channels, -1)
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


def images_of(window: Mapping[str, Any], pixels: int) -> int:
    """How many images ``pixels`` channels-last rows of the window's input hold."""
    return pixels // (int(window["height"]) * int(window["width"]))


def block_for(window: Mapping[str, Any], images: int, channels: int, outputs: int, threads: int) -> int:
    """:func:`block_tiles` of this convolution on ``threads`` threads."""
    return block_tiles(_geometry(window, images)["T"], channels, outputs, threads=threads)


def _geometry(window: Mapping[str, Any], images: int) -> dict[str, int]:
    h, w = int(window["height"]), int(window["width"])
    oh, ow = window_out(window)
    th, tw = -(-oh // TILE), -(-ow // TILE)
    return {"H": h, "W": w, "PH": int(window["ph"]), "PW": int(window["pw"]), "OH": oh, "OW": ow,
            "TH": th, "TW": tw, "T": images * th * tw}


def block_tiles(tiles: int, channels: int, outputs: int, budget: int | None = None, threads: int = 1) -> int:
    """Tiles per block: a block's transformed inputs and products take at most ``budget`` bytes (default: this
    CPU's L2, where they stay from the transform to the product to the back-transform, times the square of
    ``threads``: each block is split across them, and a product of few rows split in two ran slower than the
    block's bytes saved), but at least :data:`MIN_BLOCK` tiles (fewer rows starve the product); the blocks as even
    as can be."""
    if budget is None:
        budget = cache_levels().get(2, DEFAULT_BLOCK_BYTES) * threads * threads
    per_tile = ALPHA * ALPHA * (channels + outputs) * 4
    blocks = max(1, min(-(-per_tile * tiles // budget), tiles // MIN_BLOCK))
    return -(-tiles // blocks)


def _defines(geometry: Mapping[str, int], channels: int, block: int) -> str:
    lines = [f"#define FP_{k} {v}" for k, v in {**geometry, "B": block}.items()]
    return "\n".join([*lines, f"#define FP_C {channels}", f"#define FP_L {LANES}", ""])


def input_source(window: Mapping[str, Any], images: int, channels: int, dtype: str = "fp32",
                 block: int | None = None) -> str:
    """C for the input transform of tiles [r0, r1) of the block starting at tile b0: ``v[ij][t - b0][c]`` (36 fp32
    matrices of ``block`` rows of C) of the channels-last rows ``x`` stored as ``dtype``; a pixel outside the
    image, or of a tile past the last, reads as 0 (a row of zeros)."""
    ctype, load, _ = storage_forms(dtype)
    d = [load.format(f"p[{a} * 6 + j][c0 + k]") for a in range(ALPHA)]
    cols = _combine(B_T, [f"d{a}" for a in range(ALPHA)])
    rows = _combine(B_T, [f"s[i][{b}][k]" for b in range(ALPHA)])
    geometry = _geometry(window, images)
    return PRELUDE + _defines(geometry, channels, block or geometry["T"]) + f"""
typedef {ctype} fp_in;
static const fp_in fp_zeros[FP_C];

static inline __attribute__((always_inline)) void fp_input_block(
        const fp_in* const* restrict p, float* restrict v, int64_t t, int64_t b0, int c0, const int nl) {{
    float s[6][6][FP_L];
    for (int j = 0; j < 6; ++j)
        for (int k = 0; k < nl; ++k) {{
            const float {", ".join(f"d{a} = {e}" for a, e in enumerate(d))};
{_assign("s[{}][j][k]", cols, 12)}
        }}
    for (int i = 0; i < 6; ++i)
        for (int k = 0; k < nl; ++k) {{
{_assign("v[((int64_t)(i * 6 + {}) * FP_B + t - b0) * FP_C + c0 + k]", rows, 12)}
        }}
}}

void {SYMBOL}(const fp_in* restrict x, float* restrict v, int64_t r0, int64_t r1, int64_t b0) {{
    const fp_in* p[36];
    for (int64_t t = r0; t < r1; ++t) {{
        const int64_t n = t / (FP_TH * FP_TW), rest = t % (FP_TH * FP_TW);
        const int64_t y0 = (rest / FP_TW) * 4 - FP_PH, x0 = (rest % FP_TW) * 4 - FP_PW;
        for (int i = 0; i < 6; ++i)
            for (int j = 0; j < 6; ++j) {{
                const int64_t yy = y0 + i, xx = x0 + j;
                p[i * 6 + j] = t < FP_T && yy >= 0 && yy < FP_H && xx >= 0 && xx < FP_W
                    ? x + ((n * FP_H + yy) * FP_W + xx) * FP_C : fp_zeros;
            }}
        int c0 = 0;
        for (; c0 + FP_L <= FP_C; c0 += FP_L) fp_input_block(p, v, t, b0, c0, FP_L);
        if (c0 < FP_C) fp_input_block(p, v, t, b0, c0, FP_C % FP_L);
    }}
}}
"""


def output_source(window: Mapping[str, Any], images: int, outputs: int, block: int | None = None) -> str:
    """C for the output transform of tiles [r0, r1) of the block starting at tile b0: each tile's 4x4 outputs
    ``Aᵀ m A`` of its 36 products ``m[ij][t - b0][o]``, written to the fp32 product rows ``y`` (N*OH*OW, O)
    inside the image."""
    cols = _combine(A_T, [f"m[((int64_t)({a} * 6 + j) * FP_B + t - b0) * FP_C + c0 + k]" for a in range(ALPHA)])
    rows = _combine(A_T, [f"s[{b}][k]" for b in range(ALPHA)])
    geometry = _geometry(window, images)
    return PRELUDE + _defines(geometry, outputs, block or geometry["T"]) + f"""
static inline __attribute__((always_inline)) void fp_output_block(
        const float* restrict m, float* restrict y, int64_t t, int64_t b0, int64_t oy, int64_t ox, int64_t n, int c0,
        const int nl) {{
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

void {SYMBOL}(const float* restrict m, float* restrict y, int64_t r0, int64_t r1, int64_t b0) {{
    for (int64_t t = r0; t < r1 && t < FP_T; ++t) {{
        const int64_t n = t / (FP_TH * FP_TW), rest = t % (FP_TH * FP_TW);
        const int64_t oy = (rest / FP_TW) * 4, ox = (rest % FP_TW) * 4;
        int c0 = 0;
        for (; c0 + FP_L <= FP_C; c0 += FP_L) fp_output_block(m, y, t, b0, oy, ox, n, c0, FP_L);
        if (c0 < FP_C) fp_output_block(m, y, t, b0, oy, ox, n, c0, FP_C % FP_L);
    }}
}}
"""


def _assign(target: str, exprs: list[str], indent: int) -> str:
    pad = " " * indent
    return "\n".join(f"{pad}{target.format(i)} = {e};" for i, e in enumerate(exprs))


def sources(window: Mapping[str, Any], images: int, channels: int, outputs: int, dtype: str = "fp32",
            block: int | None = None) -> tuple[str, str]:
    """The input and output transforms' C (what :func:`winograd_conv` compiles)."""
    return input_source(window, images, channels, dtype, block), output_source(window, images, outputs, block)


def scratch_floats(window: Mapping[str, Any], images: int, channels: int, outputs: int, block: int) -> int:
    """fp32 values of work memory :func:`winograd_conv` takes: a block's transformed inputs and products and the
    product rows, each starting on a cache line."""
    return sum(_parts(window, images, channels, outputs, block))


def _parts(window: Mapping[str, Any], images: int, channels: int, outputs: int, block: int) -> tuple[int, int, int]:
    geometry = _geometry(window, images)
    cells = ALPHA * ALPHA
    sizes = (cells * block * channels, cells * block * outputs, images * geometry["OH"] * geometry["OW"] * outputs)
    return tuple(-(-n // LANES) * LANES for n in sizes)  # type: ignore[return-value]


def winograd_conv(window: Mapping[str, Any], images: int, channels: int, outputs: int,
                  function: Callable[[str, int], Any], pool: parallel.WorkerPool, threads: int,
                  dtype: str = "fp32", block: int | None = None, scratch: np.ndarray | None = None) -> Convolution:
    """``conv(x, w)``: the product ``Im2col(x) @ w`` of channels-last rows x (N*H*W, C) and the GEMM weight w
    (9*C, O), both stored as ``dtype``, by F(4x4, 3x3) in fp32, as fp32 rows (N*OH*OW, O) in work memory (the
    caller reads them before the next call).  ``function(source, pointers)``: a compiled kernel.  ``scratch``: the
    work memory, an fp32 array of at least :func:`scratch_floats` values (a plan's kernels run one at a time and
    share theirs, which then stays in cache from one to the next); else one of its own.  The tiles go in blocks
    of ``block`` (:func:`block_tiles`; None: one block), each transformed, multiplied and transformed back before
    the next, its tiles split across ``pool`` in the transforms; the batched product runs on torch's threads.  The weight's transform is kept while
    the weight is the same read-only array (a bound parameter)."""
    import torch  # optional dependency

    geometry = _geometry(window, images)
    tiles, cells = geometry["T"], ALPHA * ALPHA
    block = block or tiles
    in_src, out_src = sources(window, images, channels, outputs, dtype, block)
    transform_in, transform_out = function(in_src, 2), function(out_src, 2)
    sizes = _parts(window, images, channels, outputs, block)
    work = aligned_empty((sum(sizes),), np.float32) if scratch is None else scratch
    v = work[:cells * block * channels].reshape(cells, block, channels)
    m = work[sizes[0]:sizes[0] + cells * block * outputs].reshape(cells, block, outputs)
    y = work[sizes[0] + sizes[1]:sizes[0] + sizes[1] + images * geometry["OH"] * geometry["OW"] * outputs]
    y = y.reshape(-1, outputs)
    vt, mt = torch.from_numpy(v), torch.from_numpy(m)
    v_ptr, m_ptr, y_ptr = v.ctypes.data, m.ctypes.data, y.ctypes.data
    ranges = parallel.split(block, threads)
    blocks = [([[0, v_ptr, b0 + r0, b0 + r1, b0] for r0, r1 in ranges], [[m_ptr, y_ptr, b0 + r0, b0 + r1, b0] for r0, r1 in ranges])
              for b0 in range(0, tiles, block)]
    kept: list[tuple[np.ndarray, Any] | None] = [None]

    def transformed(w: np.ndarray) -> Any:
        hit = kept[0]
        if hit is not None and hit[0] is w:
            return hit[1]
        u = torch.from_numpy(weight_transform(w, channels, dtype))
        if not w.flags.writeable:
            kept[0] = (w, u)
        return u

    def conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        u, x_ptr = transformed(w), x.ctypes.data
        for inward, outward in blocks:
            for part in inward:
                part[0] = x_ptr
            pool.run_kernel(transform_in, 2, inward)
            torch.bmm(vt, u, out=mt)
            pool.run_kernel(transform_out, 2, outward)
        return y

    return conv


def forced() -> str:
    """:data:`CONVOLUTION_ENV`: ``auto``, or the product it forces."""
    return env_choice(CONVOLUTION_ENV, ("auto", *CONVOLUTION_KERNELS), "auto")


def measured_convolution(window: Mapping[str, Any], images: int, channels: int, outputs: int, dtype: str,
                         threads: int, measure: Callable[[], Mapping[str, float]], *, code: Sequence[str]) -> str:
    """``onednn`` or ``winograd``: which product computes this 3x3 convolution of ``dtype`` on ``threads`` threads
    (:data:`CONVOLUTION_ENV`).  ``auto`` takes the choice recorded in the kernel cache for this CPU, torch's
    version, shape, dtype, threads and Winograd's target flags (``code``), else times both (``measure()``:
    seconds per product) and takes Winograd's only where it is :data:`WINOGRAD_MARGIN` faster."""
    value = forced()
    if value != "auto":
        return value
    import torch  # optional dependency (auto measures only where it is loaded)

    key = {"cpu": cpu_model(), "torch": torch.__version__, "window": {a: int(window[a]) for a in WINDOW},
           "images": images, "channels": channels, "outputs": outputs, "dtype": dtype, "threads": threads,
           "code": list(code)}

    def decide() -> tuple[str, Mapping[str, float]]:
        seconds = measure()
        choice = "winograd" if seconds["winograd"] * (1 + WINOGRAD_MARGIN) < seconds["onednn"] else "onednn"
        log.info("%s 3x3 convolution of %sx%s pixels, padding %s,%s, %d images, %d -> %d channels on %d thread(s): "
                 "%s (oneDNN %.2f ms, Winograd %.2f ms)", dtype, window["height"], window["width"], window["ph"],
                 window["pw"], images, channels, outputs, threads, choice, seconds["onednn"] * 1e3,
                 seconds["winograd"] * 1e3)
        return choice, seconds

    return recorded_choice("convolution", key, CONVOLUTION_KERNELS, decide, "the convolution kernel choice")

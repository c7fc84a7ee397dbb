"""C code generation and compilation for the CPU backend.

A kernel body (an :class:`~planner.core.plans.Expr` tree) becomes one C function
with one loop nest over ``rows x cols`` of the output.  Every inner node is one
``const float vK = <snippet>;`` statement built from the op table's ``code``
snippet (the strings the CUDA backend reuses); every distinct :class:`Load`
is one pointer parameter read once per element.  fp16/bf16 tensors are stored
as ``uint16_t`` and converted by the helpers in :data:`PRELUDE` (float math in
registers, round-to-nearest-even on store, as ``planner.core.ops.round_to`` does).

Names never come from the graph: parameters are ``t0, t1, ...``, values
``v0, v1, ...``, the function is always ``fp_kernel``.  The only graph-derived
text in a source is what the op table's snippets print from validated
attributes (floats).

Sources are compiled by the system C compiler into shared objects cached by
the SHA-256 of (compiler, flags, source) under the user cache directory and
loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from backends.codegen import (
    CodegenError,
    RowEmitter,
    broadcast,
    is_rotated,
    is_row_kernel,
    loads,
    nodes_to_emit,
    row_level,
    row_read,
    row_width,
    snippet,
    tile_rows,
)
from planner.core.dtypes import DTYPES
from planner.core.files import untrusted_dir
from planner.core.kinds import OpKind
from planner.core.ops import op_def
from planner.core.plans import Expr, Load

log = logging.getLogger(__name__)

SYMBOL = "fp_kernel"
#: -fno-trapping-math: nothing here reads floating-point exception flags, and without it gcc 12 will not
#: if-convert a select (ReLU) followed by arithmetic, so such loops stay scalar and branchy
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fno-trapping-math")
#: FMA contraction of a*x + b (fp contract fast) or none; see Compiler.fma and docs/backends.md
CONTRACT_FLAGS = {True: "-ffp-contract=fast", False: "-ffp-contract=off"}
NATIVE_FLAGS = ("-march=native",)
#: x86 only: on AVX-512 targets gcc otherwise keeps 256-bit vectors; fused chains of a dozen or more ops
#: are bound by vector throughput, and 512-bit vectors ran them 1.6x faster here (docs/backends.md)
WIDE_VECTOR_FLAGS = ("-mprefer-vector-width=512",)
#: glibc's vector math library for tanhf/erff/expf (see PRELUDE), used when it links
VECTOR_MATH = (("-fno-math-errno", "-DFP_VECTOR_MATH=1"), ("-lmvec",))

#: index kinds of a pointer parameter: the output's layout, a row vector
#: broadcast over rows (a bias), or the fp32 GEMM tile of a GEMM+epilogue kernel
INDEX = {
    "full": "{p}[r * cols + c]",
    "col": "{p}[c]",
    "row": "{p}[r]",  # one value per row (a row kernel's per-row operand)
    "tile": "{p}[(r - r0) * cols + c]",
    "wrap": "{p}[(r % {period}) * cols + c]",  # a tile of the output's trailing dims: its rows repeat
    "group": "{p}[(r / {period}) * cols + c]",  # one row per group of {period} output rows (an attention mask)
    # RotateHalf's input: the other half's column, negated in the first half; the loop over a row runs in
    # two halves, each filling in its shift and sign (see _loop_function), so both stay contiguous loads
    "rot": "{p}[r * cols + c + FP_ROT_SHIFT]",
}

PRELUDE = r"""#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(FP_VECTOR_MATH) && defined(__x86_64__) && defined(__GLIBC__)
/* glibc declares these SIMD variants (libmvec) only under -ffast-math, which
   would also break the IEEE rounding the conversions below rely on. */
float tanhf(float) __attribute__((__simd__("notinbranch")));
float erff(float) __attribute__((__simd__("notinbranch")));
float expf(float) __attribute__((__simd__("notinbranch")));
#endif

static inline float fp_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t fp_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* ReLU as a bit mask, not a branch: gcc threads a branch into every later op of a fused chain
   (both paths, predicated), which made long chains 1.5-2x slower on AVX2; this keeps NaN and -0. */
static inline float fp_relu(float x) { return fp_bits_f32(fp_f32_bits(x) & ~(-(uint32_t)(x < 0.0f))); }

/* torch.maximum / torch.minimum as bit masks too: NaN if either operand is NaN, the second operand
   when they compare equal (so max(-0, +0) = +0 and max(+0, -0) = -0, as torch and numpy answer). */
static inline float fp_pick(float a, float b, uint32_t take_a) {
    uint32_t m = -take_a;
    return fp_bits_f32((fp_f32_bits(a) & m) | (fp_f32_bits(b) & ~m));
}
static inline float fp_max(float a, float b) { return fp_pick(a, b, (uint32_t)((a > b) | (a != a))); }
static inline float fp_min(float a, float b) { return fp_pick(a, b, (uint32_t)((a < b) | (a != a))); }

/* A row reduction's 16 partial results as one vector (GCC/clang vector extensions): gcc vectorises
   neither the NaN-keeping max of a loop-carried partial nor the loop around it otherwise. */
typedef float fp_v16 __attribute__((vector_size(64)));
typedef int32_t fp_v16i __attribute__((vector_size(64)));
static inline fp_v16 fp_v16_load(const float* p) { fp_v16 v; memcpy(&v, p, 64); return v; }
static inline fp_v16 fp_v16_fill(float x) { fp_v16 v; for (int j = 0; j < 16; ++j) v[j] = x; return v; }
static inline fp_v16 fp_v16_add(fp_v16 a, fp_v16 b) { return a + b; }
static inline fp_v16 fp_v16_max(fp_v16 a, fp_v16 b) {
    fp_v16i m = (a > b) | (a != a);
    return (fp_v16)(((fp_v16i)a & m) | ((fp_v16i)b & ~m));
}
static inline float fp_v16_hadd(fp_v16 v) {
    float p[16];
    memcpy(p, &v, 64);
    for (int h = 8; h > 0; h /= 2) for (int j = 0; j < h; ++j) p[j] = p[j] + p[j + h];
    return p[0];
}
static inline float fp_v16_hmax(fp_v16 v) {
    float p[16];
    memcpy(p, &v, 64);
    for (int h = 8; h > 0; h /= 2) for (int j = 0; j < h; ++j) p[j] = fp_max(p[j], p[j + h]);
    return p[0];
}

static inline float fp_bf16_to_f32(uint16_t h) { return fp_bits_f32((uint32_t)h << 16); }

/* Branch-free conversions (so loops vectorise); the fp16 pair follows
   Maratyszcza's FP16 library (MIT) and needs IEEE round-to-nearest-even float
   arithmetic without flush-to-zero, which these flags guarantee. */
static inline uint16_t fp_f32_to_bf16(float f) {
    uint32_t u = fp_f32_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;      /* round to nearest even */
    uint32_t qnan = (u >> 16) | 0x40u;                                /* NaN stays a (quiet) NaN */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? qnan : rounded);
}

static inline float fp_f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normal = fp_bits_f32((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
    float subnormal = fp_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t bits = two_w < (1u << 27) ? fp_f32_bits(subnormal) : fp_f32_bits(normal);
    return fp_bits_f32(sign | bits);
}

static inline uint16_t fp_f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;             /* overflows to inf where fp16 does */
    uint32_t w = fp_f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = fp_bits_f32((bias >> 1) + 0x07800000u) + base;              /* the add rounds to fp16 precision */
    uint32_t bits = fp_f32_bits(base);
    uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

/* erf as a rational function (the coefficients of Eigen's and XLA's float erf), x clamped to [-4, 4] where
   erf is +-1 in fp32: inline arithmetic, so a loop of it vectorises with no vector-math call (libmvec's erff
   ran GELU over a 128x3072 tile 2.5x slower than a ReLU); max error 4.4e-7 against fp64 erf, NaN stays NaN. */
static inline float fp_erf(float x) {
    const float c = x > 4.0f ? 4.0f : (x < -4.0f ? -4.0f : x), c2 = c * c;
    float p = -2.72614225801306e-10f;
    p = p * c2 + 2.77068142495902e-08f;
    p = p * c2 - 2.10102402082508e-06f;
    p = p * c2 - 5.69250639462346e-05f;
    p = p * c2 - 7.34990630326855e-04f;
    p = p * c2 - 2.95459980854025e-03f;
    p = p * c2 - 1.60960333262415e-02f;
    float q = -1.45660718464996e-05f;
    q = q * c2 - 2.13374055278905e-04f;
    q = q * c2 - 1.68282697438203e-03f;
    q = q * c2 - 7.37332916720468e-03f;
    q = q * c2 - 1.42647390514189e-02f;
    return c * p / q;
}

/* tanh as a rational function too (Eigen's float tanh, x clamped to +-7.905 where tanh is +-1 in fp32; near 0
   the ratio's leading terms give x within 1.3e-7 relative): the tanh GELU of a 128x3072 tile, fp32, one core,
   171 -> 142 us against libmvec's tanhf; max error 3.9e-7 against fp64 tanh, NaN stays NaN. */
static inline float fp_tanh(float x) {
    const float c = x > 7.90531110763549805f ? 7.90531110763549805f : (x < -7.90531110763549805f ? -7.90531110763549805f : x);
    const float c2 = c * c;
    float p = -2.76076847742355e-16f;
    p = p * c2 + 2.00018790482477e-13f;
    p = p * c2 - 8.60467152213735e-11f;
    p = p * c2 + 5.12229709037114e-08f;
    p = p * c2 + 1.48572235717979e-05f;
    p = p * c2 + 6.37261928875436e-04f;
    p = p * c2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * c2 + 1.18534705686654e-04f;
    q = q * c2 + 2.26843463243900e-03f;
    q = q * c2 + 4.89352518554385e-03f;
    return c * p / q;
}

/* Cast's rounding in registers: the value a store of that dtype would keep */
static inline float fp_round_bf16(float x) { return fp_bf16_to_f32(fp_f32_to_bf16(x)); }
static inline float fp_round_f16(float x) { return fp_f16_to_f32(fp_f32_to_f16(x)); }
"""

#: per storage dtype: C element type, load conversion, store conversion
_STORAGE: dict[str, tuple[str, str, str]] = {
    "fp32": ("float", "{}", "{}"),
    "fp16": ("uint16_t", "fp_f16_to_f32({})", "fp_f32_to_f16({})"),
    "bf16": ("uint16_t", "fp_bf16_to_f32({})", "fp_f32_to_bf16({})"),
}
assert set(_STORAGE) == set(DTYPES)


@dataclass(frozen=True)
class Param:
    """One pointer parameter of a generated kernel (``tensor`` is never printed)."""

    tensor: str | None  # None for the GEMM tile
    dtype: str  # storage dtype
    index: str  # key of INDEX
    period: int = 0  # a wrap operand's rows


@dataclass(frozen=True)
class CKernel:
    """A generated kernel: ``void fp_kernel(params..., out, r0, r1, cols)``."""

    source: str
    params: tuple[Param, ...]
    out_dtype: str
    rows: int
    cols: int
    #: a row kernel's row length (it runs whole rows: never flattened or split within a row); 0 otherwise
    row_width: int = 0

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


def rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """The output viewed as rows x cols, cols being the last dimension."""
    if not shape:
        return 1, 1
    cols = shape[-1]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, cols


def generate(
    body: Expr,
    tensor_types: dict[str, tuple[tuple[int, ...], str]],
    tile: Expr | None = None,
    stream: bool = False,
    tile_dtype: str = "fp32",
) -> CKernel:
    """C source of one kernel body; ``tile`` (a node of the body) reads the GEMM tile, stored as
    ``tile_dtype`` (fp32, or the 16-bit dtype of a product the library computed natively).

    ``tensor_types`` maps each loaded tensor to (shape, dtype).  ``stream``: a flat call (one row)
    of a kernel whose operands all have the output's layout and whose output is fp32 stores with
    non-temporal (streaming) stores where the compiler targets AVX (see :data:`STREAM_SOURCE`); so does
    a row kernel of fp32 rows of a multiple of 16 up to :data:`ROW_BUFFER_LIMIT` (:data:`ROW_STREAM_SOURCE`).
    """
    if tile is not None and any(op_def(e.op).kind == OpKind.REDUCTION for e in body.walk()):
        raise CodegenError(f"kernel for node {body.node!r}: a row reduction is no GEMM epilogue")
    if tile is None and is_row_kernel(body, {t: tensor_types[t][0] for t in loads(body)}):
        return _row_kernel(body, tensor_types, stream)
    out_shape = tuple(body.type.shape)
    rows, cols = rows_cols(out_shape)
    params: list[Param] = []
    var_of: dict[int, str] = {}
    param_of: dict[tuple[str | None, str], int] = {}
    stmts: list[str] = []

    def param(tensor: str | None, dtype: str, index: str, period: int = 0) -> str:
        if (tensor, index) not in param_of:
            param_of[tensor, index] = len(params)
            params.append(Param(tensor, dtype, index, period))
            p = params[-1]
            pname = f"t{param_of[tensor, index]}"
            load = INDEX[p.index].format(p=pname, period=period)
            conv = "{}" if p.dtype == "fp32" else _STORAGE[p.dtype][1]
            value = f"FP_ROT_SIGN({conv.format(load)})" if index == "rot" else conv.format(load)
            stmts.append(f"const float {pname}v = {value};")
        return f"t{param_of[tensor, index]}v"

    def operand(e: Expr | Load, rotated: bool = False) -> str:
        if isinstance(e, Load):
            if e.tensor not in tensor_types:
                raise CodegenError("kernel loads a tensor with no known type")
            shape, dtype = tensor_types[e.tensor]
            if rotated:
                if tuple(shape) != out_shape:
                    raise CodegenError(f"RotateHalf of {e.tensor!r}: shape {list(shape)} is not the output's")
                return param(e.tensor, dtype, "rot")
            per_row = len(shape) > 1 and shape[-1] == 1 and shape != out_shape and math.prod(shape[:-1]) == rows
            index = "row" if per_row else broadcast(shape, out_shape, e.tensor)
            period = {"wrap": tile_rows(shape), "group": int(out_shape[1]) if len(out_shape) == 3 else 0}.get(index, 0)
            return param(e.tensor, dtype, index, period)
        if tile is not None and e is tile:
            return param(None, tile_dtype, "tile")
        return var_of[id(e)]

    if tile is not None and tile is body:
        result = operand(body)
    for e in nodes_to_emit(body, given={id(tile)} if tile is not None else ()):
        args = [operand(a, is_rotated(e)) for a in e.args]
        name = f"v{len(var_of)}"
        var_of[id(e)] = name
        stmts.append(f"const float {name} = {snippet(e, args)};")
        result = name
    out_dtype = body.type.dtype
    in_ctypes = [_ctype(p) for p in params]
    store = _STORAGE[out_dtype][2].format(result)
    if stream and out_dtype == "fp32" and all(p.index == "full" for p in params):
        source = _streaming_function(in_ctypes, stmts, store)
    else:
        source = _loop_function(in_ctypes, _STORAGE[out_dtype][0], stmts, store)
    return CKernel(source, tuple(params), out_dtype, rows, cols)


#: partial sums (maxima) each reduction loop keeps: one 512-bit vector of fp32, so gcc vectorises it
ROW_LANES = 16
#: rows up to this long keep a reduction's input in a buffer on the stack (16 KiB of fp32 each)
ROW_BUFFER_LIMIT = 4096


#: A streaming row kernel computes each output row into an aligned buffer on the stack and moves it to memory
#: with non-temporal stores (where the row starts on a 64-byte line; else it stores the buffer as is).  On
#: 2048 rows of 2048 (RMSNorm, one core, cold caches) that took 2.8 ms to 2.2; with the output in cache it
#: cost 1.25 -> 1.5 ms, so only outputs past the streaming threshold stream, as elementwise ones do.
ROW_STREAM_SOURCE = r"""
#if defined(__AVX__)
{flush}
static inline void fp_row_store(float* restrict out, const float* restrict row, int64_t n) {{
    if (((uintptr_t)out & 63u) == 0) fp_flush(out, row, n);
    else memcpy(out, row, sizeof(float) * (size_t)n);
}}
#define FP_ROW_FENCE() _mm_sfence()
#else
static inline void fp_row_store(float* restrict out, const float* restrict row, int64_t n) {{
    memcpy(out, row, sizeof(float) * (size_t)n);
}}
#define FP_ROW_FENCE() ((void)0)
#endif
"""


def _row_kernel(body: Expr, tensor_types: dict[str, tuple[tuple[int, ...], str]], stream: bool = False) -> CKernel:
    """A kernel of one row at a time (see :class:`backends.codegen.RowEmitter`); the row
    length is a constant of the source, so the loops over it have known trip counts.  ``stream``: fp32 rows
    of a multiple of 16, up to :data:`ROW_BUFFER_LIMIT`, leave with non-temporal stores (AVX targets)."""
    rows, cols = rows_cols(tuple(body.type.shape))
    missing = [t for t in loads(body) if t not in tensor_types]
    if missing:
        raise CodegenError(f"kernel loads {missing[0]!r}, a tensor with no known type")
    width = row_width(body, {t: tensor_types[t][0] for t in loads(body)})
    params: list[Param] = []
    out_shape = tuple(body.type.shape)
    levels = {t: row_level(tensor_types[t][0], width, rows, t, out_shape) for t in loads(body)}

    def load(tensor: str, level: str) -> str:
        if tensor not in [p.tensor for p in params]:
            params.append(Param(tensor, tensor_types[tensor][1], level))
        i = [p.tensor for p in params].index(tensor)
        tile = int(out_shape[1]) if level == "group" else tile_rows(tensor_types[tensor][0])
        return row_read(level, width, tile,  # type: ignore[arg-type]
                        lambda index: _STORAGE[params[i].dtype][1].format(f"t{i}[{index}]"))

    emitter = RowEmitter(width, levels.__getitem__, load, ROW_LANES, ROW_BUFFER_LIMIT)
    out_dtype = body.type.dtype
    streams = (stream and out_dtype == "fp32" and width % 16 == 0 and width <= ROW_BUFFER_LIMIT
               and not RowEmitter.per_row(body))
    store = _STORAGE[out_dtype][2]
    if streams:
        lines = emitter.output(body, lambda value, _: f"fp_orow[c] = {value};")  # inside the loop over c
        lines = [f"float fp_orow[{width}] __attribute__((aligned(64)));", *lines,
                 f"fp_row_store(out + r * {width}, fp_orow, {width});"]
    else:
        lines = emitter.output(body, lambda value, index: f"out[{index}] = {store.format(value)};")
    sig = [f"const {_STORAGE[p.dtype][0]}* restrict t{i}" for i, p in enumerate(params)]
    sig += [f"{_STORAGE[out_dtype][0]}* restrict out", "int64_t r0", "int64_t r1", "int64_t cols"]
    inner = "\n".join(f"        {line}" for line in lines)
    head = PRELUDE + (ROW_STREAM_SOURCE.format(flush=FLUSH_SOURCE) if streams else "")
    source = (head + f"\n/* row kernel: rows of {width} */\nvoid {SYMBOL}({', '.join(sig)}) {{\n"
              "    (void)cols;\n    for (int64_t r = r0; r < r1; ++r) {\n" + inner + "\n    }\n"
              + ("    FP_ROW_FENCE();\n" if streams else "") + "}\n")
    return CKernel(source, tuple(params), out_dtype, rows, cols, width)


def _loop_function(in_ctypes: list[str], out_ctype: str, stmts: list[str], store: str) -> str:
    sig = [f"const {t}* restrict t{i}" for i, t in enumerate(in_ctypes)]
    sig += [f"{out_ctype}* restrict out", "int64_t r0", "int64_t r1", "int64_t cols"]

    def loop(first: str, end: str, shift: str = "", sign: str = "") -> str:
        inner = "\n".join(f"            {s}" for s in stmts).replace("FP_ROT_SHIFT", shift).replace("FP_ROT_SIGN", sign)
        return (f"        for (int64_t c = {first}; c < {end}; ++c) {{\n{inner}\n"
                f"            out[r * cols + c] = {store};\n        }}\n")

    if any("FP_ROT_SHIFT" in s for s in stmts):  # a rotated read: each half of the row in its own loop
        half = "    const int64_t fp_half = cols / 2;\n"
        loops = loop("0", "fp_half", "fp_half", "-") + loop("fp_half", "cols", "(-fp_half)")
    else:
        half, loops = "", loop("0", "cols")
    return (
        PRELUDE
        + f"\nvoid {SYMBOL}({', '.join(sig)}) {{\n{half}"
        + "    for (int64_t r = r0; r < r1; ++r) {\n"
        + loops
        + "    }\n}\n"
    )


#: A streaming kernel walks its output in chunks of :data:`STREAM_PAGES` 4 KiB pages, a step of
#: :data:`STREAM_STEP` floats from each page in turn, and prefetches each input :data:`STREAM_PREFETCH`
#: elements (one chunk) ahead.  The hardware prefetcher follows each 4 KiB page on its own, so several
#: pages in flight keep more lines coming than one stream does (glibc's large memcpy does the same).
#: Measured on one thread here (n = 110M, a 440 MB output, ew-chain k=2 / k=8): one stream in blocks of
#: 128 reached 89% / 72% of memcpy, four pages of 64 prefetched one chunk ahead 104-110% / 97-101%.
STREAM_PAGES = 4
STREAM_STEP = 64
STREAM_PAGE_FLOATS = 1024
STREAM_PREFETCH = STREAM_PAGES * STREAM_PAGE_FLOATS

#: ``fp_flush(out, tmp, n)``: n floats (a multiple of 16) of a 64-byte-aligned buffer stored to 64-byte-aligned
#: ``out`` with non-temporal stores, a whole line per store where the target has 512-bit vectors
FLUSH_SOURCE = r"""
#include <immintrin.h>
static inline void fp_flush(float* restrict out, const float* restrict tmp, int64_t n) {
#if defined(__AVX512F__)
    for (int64_t j = 0; j < n; j += 16) _mm512_stream_ps(out + j, _mm512_load_ps(tmp + j));
#else
    for (int64_t j = 0; j < n; j += 8) _mm256_stream_ps(out + j, _mm256_load_ps(tmp + j));
#endif
}
"""

#: A flat call's loop in steps: the vectorised loop writes each step into an aligned buffer that
#: stays in L1, and non-temporal stores move it to memory without first reading the destination's
#: lines (a plain store reads each line before writing it: 3 bytes of traffic for 2 of copy).  Each
#: store fills a whole 64-byte line where the target has 512-bit vectors: gcc interleaves the halves
#: of different lines otherwise, and the write-combining buffers flushed half lines (50% of memcpy).
#: gcc does not emit streaming stores by itself.  Other calls, and other targets, run the loop as is.
STREAM_SOURCE = r"""
#if defined(__AVX__)
{flush}
static void fp_stream({params}, float* restrict out, int64_t n) {{
    int64_t head = (int64_t)(((64u - ((uintptr_t)out & 63u)) & 63u) / 4u);
    head = head < n ? head : n;
    fp_block({args0}, out, head);
    float tmp[FP_STREAM_PAGES * FP_STREAM_STEP] __attribute__((aligned(64)));
    const int64_t chunk = FP_STREAM_PAGES * FP_STREAM_PAGE;
    int64_t i = head;
    for (; i + chunk <= n; i += chunk) {{
        for (int64_t j = 0; j < FP_STREAM_PAGE; j += FP_STREAM_STEP) {{
            for (int64_t p = 0; p < FP_STREAM_PAGES; ++p) {{
                const int64_t o = i + p * FP_STREAM_PAGE + j;
                for (int64_t k = 0; k < FP_STREAM_STEP; k += 16) {{ {prefetch} }}
                fp_block({argso}, tmp + p * FP_STREAM_STEP, FP_STREAM_STEP);
            }}
            for (int64_t p = 0; p < FP_STREAM_PAGES; ++p)
                fp_flush(out + i + p * FP_STREAM_PAGE + j, tmp + p * FP_STREAM_STEP, FP_STREAM_STEP);
        }}
    }}
    for (; i + FP_STREAM_STEP <= n; i += FP_STREAM_STEP) {{
        fp_block({argsi}, tmp, FP_STREAM_STEP);
        fp_flush(out + i, tmp, FP_STREAM_STEP);
    }}
    fp_block({argsi}, out + i, n - i);
    _mm_sfence();
}}
#endif
"""


def _streaming_function(in_ctypes: list[str], stmts: list[str], store: str) -> str:
    sig = [f"const {t}* restrict t{i}" for i, t in enumerate(in_ctypes)]
    inner = "\n".join(f"        {s}" for s in stmts)
    block = (f"\nstatic inline void fp_block({', '.join(sig + ['float* restrict out', 'int64_t cols'])}) {{\n"
             "    const int64_t r = 0;\n"
             "    for (int64_t c = 0; c < cols; ++c) {\n"
             f"{inner}\n"
             f"        out[r * cols + c] = {store};\n"
             "    }\n}\n")
    names = [f"t{i}" for i in range(len(in_ctypes))]
    prefetch = " ".join(f"__builtin_prefetch({n} + o + k + FP_STREAM_PREFETCH);" for n in names)
    stream = STREAM_SOURCE.format(flush=FLUSH_SOURCE, params=", ".join(sig), args0=", ".join(names),
                                  argso=", ".join(f"{n} + o" for n in names),
                                  argsi=", ".join(f"{n} + i" for n in names), prefetch=prefetch)
    main = _loop_function(in_ctypes, "float", stmts, store)
    head, _, loops = main.partition(f"void {SYMBOL}(")
    signature, _, rest = loops.partition("{\n")
    dispatch = ("#if defined(__AVX__)\n"
                "    if (r1 - r0 == 1) {\n"
                f"        fp_stream({', '.join(f'{n} + r0 * cols' for n in names)}, out + r0 * cols, cols);\n"
                "        return;\n    }\n#endif\n")
    defines = "".join(f"#define FP_STREAM_{k} {v}\n" for k, v in (("PAGES", STREAM_PAGES), ("STEP", STREAM_STEP),
                                                                    ("PAGE", STREAM_PAGE_FLOATS), ("PREFETCH", STREAM_PREFETCH)))
    return (head + defines + block + stream
            + f"\nvoid {SYMBOL}(" + signature + "{\n" + dispatch + rest)


def widen_source(dtype: str) -> str:
    """A kernel writing the fp32 values of a ``dtype`` tensor (GEMM operands for BLAS)."""
    ctype, load, _ = _STORAGE[dtype]
    return _loop_function([ctype], "float", [], load.format("t0[r * cols + c]"))


def narrow_source(dtype: str) -> str:
    """A kernel storing fp32 values as a ``dtype`` tensor (the result of a kernel computed in fp32)."""
    ctype, _, store = _STORAGE[dtype]
    return _loop_function(["float"], ctype, [], store.format("t0[r * cols + c]"))


def _ctype(p: Param) -> str:
    return _STORAGE[p.dtype][0]


def noop_source() -> str:
    """A kernel that does nothing, with the generated kernels' calling convention."""
    return f"#include <stdint.h>\nvoid {SYMBOL}(const float* t0, float* out, int64_t r0, int64_t r1, int64_t cols) {{ }}\n"


# ---------------------------------------------------------------- compiler


def _seal(path: Path) -> str:
    """The size and SHA-256 of a built shared object, recorded beside it."""
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def _sealed(so: Path) -> bool:
    """Does ``so`` match the size and hash recorded when it was built?  (A check against corruption and
    foreign files; the cache directory itself is trusted: docs/security.md.)"""
    try:
        return so.with_suffix(".sha256").read_text() == _seal(so)
    except OSError:
        return False


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fusion-planner/cpu``, else ``~/.cache/fusion-planner/cpu``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "fusion-planner" / "cpu"


class CompilerUnavailable(RuntimeError):
    """No working C compiler on this machine."""


#: seconds the compiler may take to print its version or build the probe, and to build one kernel
PROBE_TIMEOUT_S = 60.0
BUILD_TIMEOUT_S = float(os.environ.get("FUSION_PLANNER_CC_TIMEOUT", "300"))


def _run(cmd: list[str], timeout: float, what: str, error: type[Exception]) -> subprocess.CompletedProcess[str]:
    """Run the compiler with a timeout: a hanging compiler is an error naming the step, never a hang."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise error(f"{what} did not finish within {timeout:g} s (FUSION_PLANNER_CC_TIMEOUT sets the kernel limit)") from None
    except OSError as exc:
        raise error(f"{what} could not run: {exc}") from None


Probe = tuple[tuple[str, ...], tuple[str, ...], str]
_NATIVE = BASE_FLAGS + NATIVE_FLAGS
#: what the probe tries, best first: (flags, libraries)
PROBE_ATTEMPTS = ((_NATIVE + WIDE_VECTOR_FLAGS + VECTOR_MATH[0], VECTOR_MATH[1]), (_NATIVE + VECTOR_MATH[0], VECTOR_MATH[1]),
                  (_NATIVE, ()), (BASE_FLAGS, ()))
PROBE_SOURCE = PRELUDE + "float fp_probe(float x) { return tanhf(x) + erff(x) + expf(x); }\n"


@functools.lru_cache(maxsize=4)
def _probe(cc: str) -> Probe:
    """(flags, libraries, version line): ``-march=native`` and vector math where they work.

    The answer is kept in the kernel cache, keyed by the compiler binary (path, size, mtime) and this
    probe: each process otherwise spent about 0.15 s on two compiler runs before its first kernel."""
    path = shutil.which(cc)
    if path is None:
        raise CompilerUnavailable(f"C compiler {cc!r} not found on PATH (set CC)")
    record = _probe_record(path)
    cached = _read_probe(record)
    if cached is not None:
        return cached
    found = _run_probe(cc, path)
    if record is not None and not untrusted_dir(record.parent):
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(record, json.dumps({"flags": found[0], "libs": found[1], "version": found[2]}))
        except OSError as exc:
            log.debug("probe result not cached (%s)", exc)
    return found


def _probe_record(path: str) -> Path | None:
    try:
        st = os.stat(os.path.realpath(path))
    except OSError:
        return None
    key = hashlib.sha256(repr((os.path.realpath(path), st.st_size, st.st_mtime_ns, PROBE_SOURCE, PROBE_ATTEMPTS))
                         .encode()).hexdigest()[:24]
    return cache_dir() / f"probe-{key}.json"


def _read_probe(record: Path | None) -> Probe | None:
    """A cached probe result, if it is one the probe could have given (flags from a file never reach the
    compiler unless they are exactly one of :data:`PROBE_ATTEMPTS`)."""
    if record is None or not record.is_file() or untrusted_dir(record.parent):
        return None
    try:
        doc = json.loads(record.read_text()[:4096])
        found = (tuple(doc["flags"]), tuple(doc["libs"]), str(doc["version"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found if found[:2] in PROBE_ATTEMPTS else None


def _run_probe(cc: str, path: str) -> Probe:
    version = _run([path, "--version"], PROBE_TIMEOUT_S, f"{cc} --version", CompilerUnavailable).stdout
    version = version.splitlines()[0] if version else path
    last = ""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.c"
        src.write_text(PROBE_SOURCE)
        for flags, libs in PROBE_ATTEMPTS:
            r = _run([path, *flags, "-o", str(Path(d) / "probe.so"), str(src), *libs, "-lm"], PROBE_TIMEOUT_S,
                     f"{cc} on the probe source", CompilerUnavailable)
            if r.returncode == 0:
                if "-march=native" not in flags:
                    log.warning("%s rejects -march=native; compiling with %s (%s)", cc, " ".join(flags), last)
                elif not libs:
                    log.info("%s: no vector math library (libmvec); transcendental ops stay scalar", cc)
                return flags, libs, version
            last = r.stderr.strip()
    raise CompilerUnavailable(f"C compiler {cc!r} cannot build a shared object: {last}")


@dataclass
class Compiler:
    """Compiles C sources into cached shared objects and loads them."""

    cc: str = ""
    directory: Path | None = None
    #: contract a*x + b into one fused multiply-add (rounded once); None: $FUSION_PLANNER_CPU_FMA, default on
    fma: bool | None = None

    def __post_init__(self) -> None:
        self.cc = self.cc or os.environ.get("CC", "cc")
        if self.fma is None:
            self.fma = os.environ.get("FUSION_PLANNER_CPU_FMA", "1").strip().lower() not in ("0", "off", "false", "no")
        flags, self.libs, self.version = _probe(self.cc)
        self.flags = (*flags, CONTRACT_FLAGS[self.fma])
        self.directory = self.directory or cache_dir()
        refused = untrusted_dir(self.directory)
        if refused:  # a shared object from there would run its code when loaded
            private = Path(tempfile.mkdtemp(prefix="fusion-planner-kernels-"))
            log.warning("not using the kernel cache %s: %s; compiling into %s", self.directory, refused, private)
            self.directory = private
        self._loaded: dict[str, tuple[ctypes.CDLL, str]] = {}
        self._batches: dict[str, ctypes.CDLL] = {}
        self.compiled = 0  # sources compiled (not found in the cache) by this object

    def key(self, source: str, extra: Sequence[str] = ()) -> str:
        h = hashlib.sha256()
        for part in (self.version, " ".join((*self.flags, *extra) + self.libs), source):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def build(self, source: str, extra: Sequence[str] = ()) -> Path:
        """The shared object of ``source``, compiling it (with the ``extra`` flags too) unless cached."""
        assert self.directory is not None
        key = self.key(source, extra)
        so = self.directory / f"k{key[:32]}.so"
        if so.exists():
            if _sealed(so):
                return so
            log.warning("kernel cache entry %s does not match its recorded size and hash; rebuilding it", so.name)
            so.unlink(missing_ok=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.directory) as d:
            src = Path(d) / "kernel.c"
            src.write_text(source)
            tmp = Path(d) / "kernel.so"
            r = _run([shutil.which(self.cc) or self.cc, *self.flags, *extra, "-o", str(tmp), str(src), *self.libs, "-lm"],
                     BUILD_TIMEOUT_S, f"{self.cc} on a generated kernel", CodegenError)
            if r.returncode != 0:
                raise CodegenError(f"{self.cc} failed on a generated kernel: {r.stderr.strip()[:2000]}")
            seal = _seal(tmp)
            os.replace(tmp, so)  # atomic: concurrent builders of one key agree
            _write_atomic(so.with_suffix(".sha256"), seal)
        self.compiled += 1
        return so

    def vectorisation_report(self, source: str) -> str:
        """What the compiler says it vectorised in ``source`` (gcc's ``-fopt-info-vec-optimized``), with
        the flags kernels are built with; empty for compilers without that report."""
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "kernel.c"
            src.write_text(source)
            r = subprocess.run([shutil.which(self.cc) or self.cc, *self.flags, "-fopt-info-vec-optimized",
                                "-o", str(Path(d) / "kernel.so"), str(src), *self.libs, "-lm"],
                               capture_output=True, text=True)
        return r.stderr if r.returncode == 0 else ""

    def load(self, source: str) -> tuple[ctypes.CDLL, str]:
        """The loaded library holding ``source``'s kernel and the kernel's symbol: its own shared object,
        or the batch (:meth:`build_many`) it was compiled in."""
        key = self.key(source)
        found = self._loaded.get(key)
        if found is None:
            found = self._load_batched(key) or (self._load_own(source), SYMBOL)
            self._loaded[key] = found
        return found

    def _load_own(self, source: str) -> ctypes.CDLL:
        path = self.build(source)
        try:
            return ctypes.CDLL(str(path))
        except OSError as exc:  # an entry that passed its seal yet does not load: rebuild it once
            log.warning("kernel cache entry %s does not load (%s); rebuilding it", path.name, exc)
            path.unlink(missing_ok=True)
            return ctypes.CDLL(str(self.build(source)))

    def _load_batched(self, key: str) -> tuple[ctypes.CDLL, str] | None:
        """The batch library and symbol a ``k<key>.ref`` names, if both are intact; else None (and the
        kernel is built on its own)."""
        assert self.directory is not None
        ref = self.directory / f"k{key[:32]}.ref"
        try:
            so_name, symbol = ref.read_text().split()
        except (OSError, ValueError):
            return None
        so = self.directory / so_name
        if not (_BATCH_NAME.fullmatch(so_name) and symbol == _batched_symbol(key) and _sealed(so)):
            log.warning("kernel cache entry %s names a missing or altered batch; building the kernel alone", ref.name)
            return None
        lib = self._batches.get(so_name)
        if lib is None:
            try:
                lib = ctypes.CDLL(str(so))
            except OSError:
                return None
            self._batches[so_name] = lib
        return (lib, symbol) if hasattr(lib, symbol) else None

    def build_many(self, sources: Sequence[str], jobs: int = 1) -> int:
        """Compile every source not in the cache, a few compiler runs for all of them: each run compiles one
        translation unit holding the prelude once and a share of the kernels (their symbols renamed by
        key), ``jobs`` runs at a time.  Returns how many kernels were compiled."""
        assert self.directory is not None
        todo: dict[str, str] = {}
        for src in sources:
            key = self.key(src)
            if key in todo or key in self._loaded or not src.startswith(PRELUDE):
                continue
            if (self.directory / f"k{key[:32]}.so").exists() or (self.directory / f"k{key[:32]}.ref").exists():
                continue
            todo[key] = src
        if not todo:
            return 0
        self.directory.mkdir(parents=True, exist_ok=True)
        items = sorted(todo.items())
        groups = [items[i::max(1, jobs)] for i in range(max(1, min(jobs, len(items))))]
        with tempfile.TemporaryDirectory(dir=self.directory) as d:
            runs = [self._start_batch(Path(d), group) for group in groups]
            built = sum(len(group) for proc, tmp, group in runs if self._finish_batch(proc, tmp, group, BUILD_TIMEOUT_S))
        self.compiled += built
        return built

    def _start_batch(self, d: Path, group: list[tuple[str, str]]) -> tuple[subprocess.Popen[str], Path, list[tuple[str, str]]]:
        parts = [PRELUDE]
        for key, src in group:
            parts.append(_renamed(src[len(PRELUDE):], key))
        digest = hashlib.sha256("".join(k for k, _ in group).encode()).hexdigest()[:32]
        c_file, tmp = d / f"{digest}.c", d / f"{digest}.so"
        c_file.write_text("\n".join(parts))
        cmd = [shutil.which(self.cc) or self.cc, *self.flags, "-o", str(tmp), str(c_file), *self.libs, "-lm"]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            raise CodegenError(f"{self.cc} could not run: {exc}") from None
        return proc, tmp, group

    def _finish_batch(self, proc: subprocess.Popen[str], tmp: Path, group: list[tuple[str, str]], timeout: float) -> bool:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise CodegenError(f"{self.cc} on a batch of {len(group)} kernels did not finish within {timeout:g} s "
                               "(FUSION_PLANNER_CC_TIMEOUT sets the limit)") from None
        if proc.returncode != 0:  # one bad kernel must not cost the others: each is built alone on first use
            log.warning("%s failed on a batch of %d kernels; they will be compiled one by one: %s",
                        self.cc, len(group), err.strip()[:500])
            return False
        assert self.directory is not None
        name = f"b{tmp.stem}.so"
        seal = _seal(tmp)
        os.replace(tmp, self.directory / name)
        _write_atomic((self.directory / name).with_suffix(".sha256"), seal)
        for key, _ in group:
            _write_atomic(self.directory / f"k{key[:32]}.ref", f"{name} {_batched_symbol(key)}\n")
        return True

    def function(self, source: str, n_pointers: int) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        """``source``'s kernel: ``n_pointers`` pointers, then three int64 row/col arguments."""
        lib, symbol = self.load(source)
        fn = getattr(lib, symbol)
        fn.argtypes = [ctypes.c_void_p] * n_pointers + [ctypes.c_int64] * 3
        fn.restype = None
        return fn


#: the file-level names of a generated source, renamed per kernel when kernels share a batch
_RENAME = re.compile(r"\bfp_(?:kernel|block|stream|flush|row_store)\b")  # a kernel's own functions
_BATCH_NAME = re.compile(r"b[0-9a-f]{32}\.so")


def _renamed(body: str, key: str) -> str:
    return _RENAME.sub(lambda m: f"{m.group(0)}_{key[:16]}", body)


def _batched_symbol(key: str) -> str:
    return f"{SYMBOL}_{key[:16]}"

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

Sources are compiled by :mod:`backends.cpu.compiler`; the prelude and flags are :mod:`backends.cpu.prelude`'s.
"""

from __future__ import annotations

import hashlib
import logging
import math
import textwrap
from dataclasses import dataclass

from backends.codegen import (
    CodegenError,
    RowEmitter,
    broadcast,
    group_rows,
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
from backends.cpu.prelude import INDEX, PRELUDE, SYMBOL, with_simd
from planner.core.dtypes import DTYPES
from planner.core.kinds import OpKind
from planner.core.ops import op_def
from planner.core.plans import Expr, Load

log = logging.getLogger(__name__)

_STORAGE: dict[str, tuple[str, str, str]] = {
    "fp32": ("float", "{}", "{}"),
    "fp16": ("uint16_t", "fp_f16_to_f32({})", "fp_f32_to_f16({})"),
    "bf16": ("uint16_t", "fp_bf16_to_f32({})", "fp_f32_to_bf16({})"),
}
assert set(_STORAGE) == set(DTYPES)


def storage_forms(dtype: str) -> tuple[str, str, str]:
    """A dtype's C storage type, and the format strings that load one as a float and store a float as one."""
    return _STORAGE[dtype]


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
            period = {"wrap": tile_rows(shape), "group": group_rows(shape, out_shape)}.get(index, 0)
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
    return CKernel(with_simd(source), tuple(params), out_dtype, rows, cols)


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
        shape = tensor_types[tensor][0]
        tile = group_rows(shape, (*out_shape[:-1], width)) if level == "group" else tile_rows(shape)
        return row_read(level, width, tile,  # type: ignore[arg-type]
                        lambda index: _STORAGE[params[i].dtype][1].format(f"t{i}[{index}]"))

    emitter = RowEmitter(width, levels.__getitem__, load, ROW_LANES, ROW_BUFFER_LIMIT)
    out_dtype = body.type.dtype
    streams = (stream and out_dtype == "fp32" and width % 16 == 0 and width <= ROW_BUFFER_LIMIT
               and not RowEmitter.per_row(body))
    store = _STORAGE[out_dtype][2]
    if streams:
        lines = emitter.output(body, lambda value, _: f"fp_orow[c] = {value};")  # inside the loop over c
        lines = [f"float fp_orow[{width}] __attribute__((aligned(64)));", *_prefetching(lines, params, width),
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
    return CKernel(with_simd(source), tuple(params), out_dtype, rows, cols, width)


def _prefetching(lines: list[str], params: list[Param], width: int) -> list[str]:
    """A streaming row kernel's statements with its last loop over the row (the one writing the output) in blocks
    of 16 columns, each block first prefetching the same columns of the next row of every operand read a full row
    at a time.  The hardware's streamer stops at each 4 KiB page, and the row's passes from cache left the memory
    idle: on 2048 rows of 2048 (RMSNorm, fp32, one Sapphire Rapids core) 1.62 ms became 1.37 (a prefetch of the
    next row all at once before the loop: 1.48; during the first pass: slower)."""
    head = f"for (long long c = 0; c < {width}; ++c) {{"
    full = [i for i, p in enumerate(params) if p.index == "full"]
    at = max((i for i, line in enumerate(lines) if line == head), default=None)
    if at is None or not full:
        return lines
    end = next(i for i in range(at + 1, len(lines)) if lines[i] == "}")
    fetch = [f"    __builtin_prefetch(&t{i}[(r + 1) * {width} + c0], 0, 3);" for i in full]
    return [*lines[:at], f"for (long long c0 = 0; c0 < {width}; c0 += 16) {{", *fetch,
            "    for (long long c = c0; c < c0 + 16; ++c) {", *(f"    {line}" for line in lines[at + 1:end]), "    }",
            "}", *lines[end + 1:]]


#: the columns of a row's overlapping blocks (:func:`_loop_function`): one 512-bit vector of fp32
TAIL_BLOCK = 16


def _loop_function(in_ctypes: list[str], out_ctype: str, stmts: list[str], store: str) -> str:
    """The kernel over rows ``r0..r1`` of ``cols`` columns.  gcc vectorises a loop of a runtime length as a
    vector loop, one half-width vector step and a scalar remainder: up to 15 elements where 16-bit storage makes
    the vector 32 elements, 7 for fp32's 16.  On channels-last rows of 24-200 channels (bf16, one core) that
    remainder took 2-4x the whole vectorised rest of the row, so a row with one runs in blocks of exactly
    :data:`TAIL_BLOCK` columns, the last block overlapping the one before.  An element computed twice is written
    twice with the same value: a kernel's output shares no memory with what it reads (``restrict``, and
    ``buffers.shared_buffers``)."""
    sig = [f"const {t}* restrict t{i}" for i, t in enumerate(in_ctypes)]
    sig += [f"{out_ctype}* restrict out", "int64_t r0", "int64_t r1", "int64_t cols"]

    def element(indent: str, shift: str = "", sign: str = "") -> str:
        lines = [*stmts, f"out[r * cols + c] = {store};"]
        return "\n".join(f"{indent}{s}" for s in lines).replace("FP_ROT_SHIFT", shift).replace("FP_ROT_SIGN", sign)

    def loop(first: str, end: str, shift: str = "", sign: str = "") -> str:
        return f"        for (int64_t c = {first}; c < {end}; ++c) {{\n{element(' ' * 12, shift, sign)}\n        }}\n"

    def rows(loops: str) -> str:
        return "    for (int64_t r = r0; r < r1; ++r) {\n" + loops + "    }\n"

    if any("FP_ROT_SHIFT" in s for s in stmts):  # a rotated read: each half of the row in its own loop
        body = ("    const int64_t fp_half = cols / 2;\n"
                + rows(loop("0", "fp_half", "fp_half", "-") + loop("fp_half", "cols", "(-fp_half)")))
    else:
        blocks = (f"        for (int64_t fp_b = 0; fp_b < cols; fp_b += {TAIL_BLOCK}) {{\n"
                  f"            const int64_t fp_c0 = fp_b + {TAIL_BLOCK} <= cols ? fp_b : cols - {TAIL_BLOCK};\n"
                  # not unrolled before the vectoriser sees it: unrolled, ReLU's select is branches there
                  '            _Pragma("GCC unroll 1")\n'
                  f"            for (int64_t fp_j = 0; fp_j < {TAIL_BLOCK}; ++fp_j) {{\n"
                  "                const int64_t c = fp_c0 + fp_j;\n"
                  f"{element(' ' * 16)}\n            }}\n        }}\n")
        step = TAIL_BLOCK if "uint16_t" in (out_ctype, *in_ctypes) else TAIL_BLOCK // 2  # the half-width step
        body = (f"    if (cols % {step} != 0 && cols > {TAIL_BLOCK}) {{\n" + textwrap.indent(rows(blocks), "    ")
                + "        return;\n    }\n"
                + rows(loop("0", "cols")))
    return PRELUDE + f"\nvoid {SYMBOL}({', '.join(sig)}) {{\n" + body + "}\n"


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



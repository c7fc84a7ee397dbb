"""CUDA C generation for plan kernels, from the op table's code snippets.

Two kernel shapes are generated:

* ``elementwise``: one fused kernel per plan kernel.  A grid-stride loop over
  16-byte vectors (``VEC`` elements per thread per step; loads and stores as
  ``uint4``/``uint2`` raw words) followed by a scalar tail.  Values are
  converted to fp32 at load and rounded to the tensor's dtype at store.
* ``gemm_epilogue``: a tensor-core (wmma, fp16/bf16 in, fp32 accumulate) GEMM
  with shared-memory tiles whose epilogue is the rest of the kernel body.

Every op's arithmetic comes from ``OpDef.code``; an op with ``probe_temps`` > 0
becomes the C-05 register-pressure probe.  No graph text reaches the source:
tensors become ``p0..pn``, values ``a*``/``t*``, and the kernel name is built
from a sanitised tensor name.  Shapes are compile-time constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backends.codegen import (
    CodegenError,
    RowEmitter,
    broadcast,
    find_matmul,
    group_rows,
    is_rotated,
    is_row_kernel,
    loads,
    row_level,
    row_read,
    row_width,
    tile_rows,
)
from backends.cupy.kernel import (
    BLOCK,
    CTYPE,
    FROM_FLOAT,
    GEMM_THREADS,
    GEMM_TILE,
    PRELUDE,
    RAW,
    TO_FLOAT,
    CudaKernel,
    emit_body,
    kernel_name,
    shape_salt,
)
from backends.cupy.standalone import standalone_kernel
from planner.core.dtypes import DTYPES
from planner.core.graph import TensorType
from planner.core.kinds import KernelKind
from planner.core.plans import Expr, Kernel, Load

# ---------------------------------------------------------------- elementwise


def _modulus(t: TensorType, out: TensorType, tensor: str) -> int:
    """0 for a full-shape operand; else the flat index modulo which it is read: its size (a bias broadcast over
    rows, a tile of the output's trailing dimensions repeated over the leading ones); for one row per group
    (an attention mask, ``group``), the row's length, negated."""
    how = broadcast(t.shape, out.shape, tensor)
    if how == "group":
        return -int(t.shape[-1])
    return 0 if how == "full" else math.prod(t.shape)


def _plain_at(m: int, i: str, group_elems: int) -> str:
    """Where a plain read of modulus ``m`` (:func:`_modulus`) reads at flat output index ``i``."""
    if m < 0:  # one row of -m keys per group of group_elems output elements
        return f"({i} / {group_elems}LL) * {-m}LL + {i} % {-m}LL"
    return f"{i} % {m}LL" if m else i


def _reads(body: Expr) -> tuple[set[str], set[str]]:
    """The tensors the body reads at their own index, and those it reads rotated (``RotateHalf``'s input)."""
    plain: set[str] = set()
    rotated: set[str] = set()
    for e in body.walk():
        for a in e.args:
            if isinstance(a, Load):
                (rotated if is_rotated(e) else plain).add(a.tensor)
    return plain, rotated


def _rotated_load(p: str, dt: str, at: str, col: str, half: int) -> str:
    """``RotateHalf``'s input at flat index ``at`` of column ``col``: the other half's value, negated in the
    first half."""
    lo, hi = TO_FLOAT[dt].format(f"{p}[{at} + {half}LL]"), TO_FLOAT[dt].format(f"{p}[{at} - {half}LL]")
    return f"({col} < {half}LL ? -{lo} : {hi})"


def elementwise_kernel(k: Kernel, tensors: dict[str, TensorType]) -> CudaKernel:
    body = k.body
    out_t = tensors.get(k.out, body.type)
    n = math.prod(out_t.shape)
    leaves = loads(body)
    plain, rotated = _reads(body)
    mod = {t: _modulus(tensors[t], out_t, t) for t in leaves if t in plain}
    for t in rotated:
        if tensors[t].shape != out_t.shape:
            raise CodegenError(f"RotateHalf of {t!r}: shape {list(tensors[t].shape)} is not the output's")
    half = int(out_t.shape[-1]) // 2
    widths = [DTYPES[tensors[t].dtype].bytes for t, m in mod.items() if not m] + [DTYPES[out_t.dtype].bytes]
    vec = 16 // max(widths)
    if any(m and m % vec for m in mod.values()) or (rotated and half % vec) or n < vec:  # lanes in one row
        vec = 1
    index = {t: i for i, t in enumerate(leaves)}
    params = [f"const {CTYPE[tensors[t].dtype]}* __restrict__ p{index[t]}" for t in leaves]
    params.append(f"{CTYPE[out_t.dtype]}* __restrict__ out")
    name = kernel_name(KernelKind.ELEMENTWISE, k.out, shape_salt(k, tensors))
    src = [PRELUDE, f'extern "C" __global__ void {name}({", ".join(params)}) {{']
    src.append(f"  const long long N = {n}LL;")
    src.append("  const long long stride = (long long)blockDim.x * gridDim.x;")
    src.append("  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;")
    grouped = {group_rows(tensors[t].shape, out_t.shape) for t, m in mod.items() if m < 0}
    if len(grouped) > 1:
        raise CodegenError(f"operands read one row per group of {sorted(grouped)} output rows in one kernel")
    group = grouped.pop() * int(out_t.shape[-1]) if grouped else 0  # output elements per group
    reads = _Reads(index, mod, rotated, tensors, int(out_t.shape[-1]), half, group)
    if vec > 1:
        src += _vector_loop(body, reads, out_t, vec)
        src.append(f"  for (long long i = (N / {vec}) * {vec} + tid; i < N; i += stride) {{")
    else:
        src.append("  for (long long i = tid; i < N; i += stride) {")
    src += _scalar_step(body, reads, out_t)
    src.append("  }")
    src.append("}")
    work = -(-n // (vec * BLOCK))
    return CudaKernel(name, KernelKind.ELEMENTWISE, "\n".join(src) + "\n", (*leaves, k.out), BLOCK, (work, 1), 8, vec)


@dataclass(frozen=True)
class _Reads:
    """How an elementwise kernel reads its tensors: parameter index, modulus (plain reads), rotated reads."""

    index: dict[str, int]
    mod: dict[str, int]
    rotated: set[str]
    tensors: dict[str, TensorType]
    cols: int
    half: int
    group: int  # output elements per group (a group read's row is the flat index over it)

    def plain_var(self, t: str, lane: int) -> str:
        return f"a{self.index[t]}_{lane}"

    def rotated_var(self, t: str, lane: int) -> str:
        return f"b{self.index[t]}_{lane}"


def _vector_loop(body: Expr, reads: _Reads, out_t: TensorType, vec: int) -> list[str]:
    ind = "    "
    lines = [f"  for (long long v = tid; v < N / {vec}; v += stride) {{", f"{ind}const long long i0 = v * {vec};"]
    for t, m in reads.mod.items():
        i, dt = reads.index[t], reads.tensors[t].dtype
        if m:
            lines.append(f"{ind}const long long c{i} = {_plain_at(m, 'i0', reads.group)};")
            for lane in range(vec):
                lines.append(f"{ind}float a{i}_{lane} = {TO_FLOAT[dt].format(f'p{i}[c{i} + {lane}]')};")
            continue
        raw = RAW[vec * DTYPES[dt].bytes]
        lines.append(f"{ind}{raw} r{i} = reinterpret_cast<const {raw}*>(p{i})[v];")
        lines.append(f"{ind}const {CTYPE[dt]}* e{i} = reinterpret_cast<const {CTYPE[dt]}*>(&r{i});")
        for lane in range(vec):
            lines.append(f"{ind}float a{i}_{lane} = {TO_FLOAT[dt].format(f'e{i}[{lane}]')};")
    if reads.rotated:  # the vector's lanes lie in one half of the row (half % vec == 0)
        lines.append(f"{ind}const long long col0 = i0 % {reads.cols}LL;")
    for t in sorted(reads.rotated, key=reads.index.__getitem__):
        i, dt = reads.index[t], reads.tensors[t].dtype
        for lane in range(vec):
            lines.append(f"{ind}float b{i}_{lane} = "
                         f"{_rotated_load(f'p{i}', dt, f'i0 + {lane}', 'col0', reads.half)};")
    stmts, res = emit_body(body, vec, reads.plain_var, indent=ind, rotated_var=reads.rotated_var)
    lines += stmts
    raw = RAW[vec * DTYPES[out_t.dtype].bytes]
    ct = CTYPE[out_t.dtype]
    lines.append(f"{ind}{raw} w;")
    lines.append(f"{ind}{ct}* we = reinterpret_cast<{ct}*>(&w);")
    for lane in range(vec):
        lines.append(f"{ind}we[{lane}] = {FROM_FLOAT[out_t.dtype].format(res[lane])};")
    lines.append(f"{ind}reinterpret_cast<{raw}*>(out)[v] = w;")
    lines.append("  }")
    return lines


def _scalar_step(body: Expr, reads: _Reads, out_t: TensorType) -> list[str]:
    ind = "    "
    lines = []
    for t, m in reads.mod.items():
        i, dt = reads.index[t], reads.tensors[t].dtype
        at = _plain_at(m, "i", reads.group)
        lines.append(f"{ind}float a{i}_0 = {TO_FLOAT[dt].format(f'p{i}[{at}]')};")
    if reads.rotated:
        lines.append(f"{ind}const long long col = i % {reads.cols}LL;")
    for t in sorted(reads.rotated, key=reads.index.__getitem__):
        i, dt = reads.index[t], reads.tensors[t].dtype
        lines.append(f"{ind}float b{i}_0 = {_rotated_load(f'p{i}', dt, 'i', 'col', reads.half)};")
    stmts, res = emit_body(body, 1, reads.plain_var, indent=ind, rotated_var=reads.rotated_var)
    lines += stmts
    lines.append(f"{ind}out[i] = {FROM_FLOAT[out_t.dtype].format(res[0])};")
    return lines


# ---------------------------------------------------------------- GEMM + epilogue

_GEMM_TEMPLATE = """#include <mma.h>
using namespace nvcuda;

extern "C" __global__ void __launch_bounds__({threads}) {name}({params}) {{
  constexpr int M = {m}, N = {n}, K = {k};
  constexpr int BM = {bm}, BN = {bn}, BK = {bk};
  constexpr int LDA = BK + 8, LDB = BN + 8, LDC = 20;
  __shared__ __align__(32) {ab} As[BM * LDA];
  __shared__ __align__(32) {ab} Bs[BK * LDB];
  __shared__ __align__(32) float Cs[{warps} * 16 * LDC];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / 4, wn = warp % 4;  // 2 x 4 warps, each 64 x 32
  const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
  const {ab} zero = {zero};
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  for (int k0 = 0; k0 < K; k0 += BK) {{
    for (int c = tid; c < BM * BK / 8; c += {threads}) {{
      const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
      const int gr = row0 + r, gk = k0 + kc;
      {ab}* dst = &As[r * LDA + kc];
      if ((K % 8 == 0) && gr < M && gk + 8 <= K) {{
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&{a}[(long long)gr * K + gk]);
      }} else {{
        for (int t = 0; t < 8; ++t) dst[t] = (gr < M && gk + t < K) ? {a}[(long long)gr * K + gk + t] : zero;
      }}
    }}
    for (int c = tid; c < BK * BN / 8; c += {threads}) {{
      const int r = c / (BN / 8), nc = (c % (BN / 8)) * 8;
      const int gk = k0 + r, gc = col0 + nc;
      {ab}* dst = &Bs[r * LDB + nc];
      if ((N % 8 == 0) && gk < K && gc + 8 <= N) {{
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(&{b}[(long long)gk * N + gc]);
      }} else {{
        for (int t = 0; t < 8; ++t) dst[t] = (gk < K && gc + t < N) ? {b}[(long long)gk * N + gc + t] : zero;
      }}
    }}
    __syncthreads();
    for (int kk = 0; kk < BK; kk += 16) {{
      wmma::fragment<wmma::matrix_a, 16, 16, 16, {ab}, wmma::row_major> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, {ab}, wmma::row_major> fb[2];
      for (int i = 0; i < 4; ++i) wmma::load_matrix_sync(fa[i], &As[(wm * 64 + i * 16) * LDA + kk], LDA);
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &Bs[kk * LDB + wn * 32 + j * 16], LDB);
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }}
    __syncthreads();
  }}
  float* cw = &Cs[warp * 16 * LDC];
  for (int i = 0; i < 4; ++i) {{
    for (int j = 0; j < 2; ++j) {{
      wmma::store_matrix_sync(cw, acc[i][j], LDC, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {{
        const int gr = row0 + wm * 64 + i * 16 + e / 16, gc = col0 + wn * 32 + j * 16 + e % 16;
        if (gr < M && gc < N) {{
          const long long i_out = (long long)gr * N + gc;
          const float acc_v = cw[(e / 16) * LDC + e % 16];
{epilogue}
          out[i_out] = {store};
        }}
      }}
      __syncwarp();
    }}
  }}
}}
"""


def gemm_kernel(k: Kernel, tensors: dict[str, TensorType]) -> CudaKernel:
    body = k.body
    mm = find_matmul(body)
    a_name, b_name = (arg.tensor for arg in mm.args)  # type: ignore[union-attr]
    at, bt = tensors[a_name], tensors[b_name]
    if at.dtype != bt.dtype or at.dtype not in ("fp16", "bf16"):
        raise CodegenError(
            f"custom GEMM for {k.out!r} needs fp16 or bf16 operands of one dtype, got {at.dtype} and {bt.dtype}"
        )
    (m, kk), (_, n) = at.shape, bt.shape
    out_t = tensors.get(k.out, body.type)
    leaves = loads(body)
    index = {t: i for i, t in enumerate(leaves)}
    epi_leaves = [t for t in leaves if t not in (a_name, b_name) or _used_outside(body, mm, t)]
    ind = "          "
    lines = []
    plain, rotated = _reads(body)
    for t in epi_leaves:
        if t in plain or t not in rotated:
            how = broadcast(tensors[t].shape, out_t.shape, t)
            at_ = {"full": "i_out", "col": "gc"}.get(how, f"i_out % {math.prod(tensors[t].shape)}LL")
            lines.append(f"{ind}const float a{index[t]}_0 = {TO_FLOAT[tensors[t].dtype].format(f'p{index[t]}[{at_}]')};")
        if t in rotated:
            value = _rotated_load(f"p{index[t]}", tensors[t].dtype, "i_out", "gc", n // 2)
            lines.append(f"{ind}const float b{index[t]}_0 = {value};")
    stmts, res = emit_body(body, 1, lambda t, lane: f"a{index[t]}_0", fixed={id(mm): ["acc_v"]}, indent=ind,
                           rotated_var=lambda t, lane: f"b{index[t]}_0")
    lines += stmts
    params = [f"const {CTYPE[tensors[t].dtype]}* __restrict__ p{index[t]}" for t in leaves]
    params.append(f"{CTYPE[out_t.dtype]}* __restrict__ out")
    name = kernel_name(KernelKind.GEMM_EPILOGUE, k.out, shape_salt(k, tensors))
    bm, bn, bk = GEMM_TILE
    src = PRELUDE + _GEMM_TEMPLATE.format(
        threads=GEMM_THREADS,
        warps=GEMM_THREADS // 32,
        name=name,
        params=", ".join(params),
        m=m,
        n=n,
        k=kk,
        bm=bm,
        bn=bn,
        bk=bk,
        ab=CTYPE[at.dtype],
        zero=FROM_FLOAT[at.dtype].format("0.0f"),
        a=f"p{index[a_name]}",
        b=f"p{index[b_name]}",
        epilogue="\n".join(lines),
        store=FROM_FLOAT[out_t.dtype].format(res[0]),
    )
    grid = (-(-n // bn), -(-m // bm))
    return CudaKernel(name, KernelKind.GEMM_EPILOGUE, src, (*leaves, k.out), GEMM_THREADS, grid)


def _used_outside(body: Expr, mm: Expr, tensor: str) -> bool:
    """Whether an epilogue op (not the MatMul) also loads ``tensor``."""
    return any(e is not mm and any(isinstance(a, Load) and a.tensor == tensor for a in e.args) for e in body.walk())


#: a row kernel's block: one block per row, its threads striding over the columns, at least 4 columns each
ROW_THREADS_MIN, ROW_THREADS_MAX = 32, 256
#: CUDA's largest grid in x
MAX_GRID_X = 2**31 - 1


def row_threads(width: int) -> int:
    """Threads per row: a power of two from one warp to ``ROW_THREADS_MAX``, about 4 columns per thread."""
    t = ROW_THREADS_MIN
    while t * 2 <= min(ROW_THREADS_MAX, width // 4):
        t *= 2
    return t


def row_kernel(k: Kernel, tensors: dict[str, TensorType]) -> CudaKernel:
    """A row kernel (a body with a row reduction or per-row values) as one block per row: the C backend's row
    statements (``RowEmitter``), each column loop shared by the block's threads (coalesced reads), each
    reduction combined by warp shuffles and across warps in shared memory."""
    body = k.body
    out_t = tensors.get(k.out, body.type)
    leaves = loads(body)
    shapes = {t: tensors[t].shape for t in leaves}
    width = row_width(body, shapes)
    rows = math.prod(out_t.shape[:-1])
    levels = {t: row_level(shapes[t], width, rows, t, out_t.shape) for t in leaves}
    index = {t: i for i, t in enumerate(leaves)}

    def load(tensor: str, level: str) -> str:
        tile = group_rows(shapes[tensor], (*out_t.shape[:-1], width)) if level == "group" else tile_rows(shapes[tensor])
        return row_read(level, width, tile,  # type: ignore[arg-type]
                        lambda at: TO_FLOAT[tensors[tensor].dtype].format(f"p{index[tensor]}[{at}]"), "LL")

    if rows > MAX_GRID_X:
        raise CodegenError(f"row kernel writing {k.out!r}: {rows} rows, a block each, pass CUDA's grid limit of "
                           f"{MAX_GRID_X} blocks")
    threads = row_threads(width)
    emitter = RowEmitter(width, levels.__getitem__, load, 1, threads=threads)
    lines = emitter.output(body, lambda value, at: f"out[{at}] = {FROM_FLOAT[out_t.dtype].format(value)};")
    params = [f"const {CTYPE[tensors[t].dtype]}* __restrict__ p{index[t]}" for t in leaves]
    params.append(f"{CTYPE[out_t.dtype]}* __restrict__ out")
    name = kernel_name(KernelKind.ELEMENTWISE, k.out, shape_salt(k, tensors))
    shared = ["  __shared__ float fp_red[32];"] if threads > 32 else []
    src = [PRELUDE, f'extern "C" __global__ void {name}({", ".join(params)}) {{', *shared,
           "  const long long r = blockIdx.x;", *(f"  {line}" for line in lines), "}"]
    return CudaKernel(name, KernelKind.ELEMENTWISE, "\n".join(src) + "\n", (*leaves, k.out), threads, (rows, 1))


def generate(k: Kernel, tensors: dict[str, TensorType]) -> CudaKernel:
    """The CUDA kernel of one plan kernel (elementwise, gemm_epilogue or standalone)."""
    if k.kind == KernelKind.ELEMENTWISE and is_row_kernel(k.body, {t: tensors[t].shape for t in loads(k.body)}):
        return row_kernel(k, tensors)
    if k.kind == KernelKind.ELEMENTWISE:
        return elementwise_kernel(k, tensors)
    if k.kind == KernelKind.GEMM_EPILOGUE:
        return gemm_kernel(k, tensors)
    if k.kind == KernelKind.STANDALONE:
        return standalone_kernel(k, tensors)
    raise CodegenError(f"kernel {k.describe()} writing {k.out!r} is {k.kind}: not generated as CUDA")

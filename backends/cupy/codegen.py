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

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backends.codegen import (
    CodegenError,
    RowEmitter,
    broadcast,
    find_matmul,
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
from planner.core.graph import TensorType
from planner.core.kinds import KernelKind
from planner.core.ops import op_def
from planner.core.plans import Expr, Kernel, Load, expr_to_json

BLOCK = 256
GEMM_TILE = (128, 128, 32)  # BM, BN, BK
GEMM_THREADS = 256

CTYPE = {"fp32": "float", "fp16": "__half", "bf16": "__nv_bfloat16"}
TO_FLOAT = {"fp32": "{}", "fp16": "__half2float({})", "bf16": "__bfloat162float({})"}
FROM_FLOAT = {"fp32": "{}", "fp16": "__float2half_rn({})", "bf16": "__float2bfloat16_rn({})"}
RAW = {4: "unsigned int", 8: "uint2", 16: "uint4"}

PRELUDE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
#ifndef FP_PRELUDE
#define FP_PRELUDE
__host__ __device__ __forceinline__ float fp_relu(float x) { return x < 0.0f ? 0.0f : x; }
__host__ __device__ __forceinline__ float fp_max(float a, float b) { return (a > b || a != a) ? a : b; }
__host__ __device__ __forceinline__ float fp_min(float a, float b) { return (a < b || a != a) ? a : b; }
__host__ __device__ __forceinline__ float fp_erf(float x) { return erff(x); }
__host__ __device__ __forceinline__ float fp_tanh(float x) { return tanhf(x); }
__host__ __device__ __forceinline__ float fp_round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__host__ __device__ __forceinline__ float fp_round_f16(float x) { return __half2float(__float2half_rn(x)); }
__host__ __device__ __forceinline__ float fp_bits_f32(unsigned int u) { union { unsigned int u; float f; } v = {u}; return v.f; }
__host__ __device__ __forceinline__ float fp_neg_inf() { return fp_bits_f32(0xff800000u); }
#endif
"""


@dataclass(frozen=True)
class CudaKernel:
    """One generated kernel: source, parameter order and launch shape."""

    name: str
    kind: str  # a KernelKind: elementwise or gemm_epilogue
    source: str
    params: tuple[str, ...]  # tensor names in parameter order; the output is last
    block: int
    #: elementwise: grid = min(grid_per_sm * SMs, work_blocks); gemm: fixed (x, y)
    grid: tuple[int, int]
    grid_per_sm: int = 0
    vec: int = 1

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    def grid_for(self, sm_count: int) -> tuple[int, int]:
        if self.grid_per_sm:
            return (max(1, min(self.grid_per_sm * sm_count, self.grid[0])), 1)
        return self.grid

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.kind,
            "source": self.source,
            "params": list(self.params),
            "block": self.block,
            "grid": list(self.grid),
            "grid_per_sm": self.grid_per_sm,
            "vec": self.vec,
        }


def cuda_kernel_from_json(d: dict) -> CudaKernel:
    return CudaKernel(
        name=str(d["name"]),
        kind=str(d["kind"]),
        source=str(d["source"]),
        params=tuple(str(p) for p in d["params"]),
        block=int(d["block"]),
        grid=(int(d["grid"][0]), int(d["grid"][1])),
        grid_per_sm=int(d.get("grid_per_sm", 0)),
        vec=int(d.get("vec", 1)),
    )


def sanitize(name: str, limit: int = 40) -> str:
    """A C identifier fragment from arbitrary text: [A-Za-z0-9_] only, bounded length."""
    s = re.sub(r"[^A-Za-z0-9_]", "_", name)[:limit]
    return s or "t"


_NAME_TAG: dict[str, str] = {KernelKind.ELEMENTWISE: "ew", KernelKind.STANDALONE: "sa"}


def kernel_name(kind: str, out: str, salt: str) -> str:
    h = hashlib.sha256(f"{kind}:{out}:{salt}".encode()).hexdigest()[:8]
    return f"fp_{_NAME_TAG.get(kind, 'gemm')}_{sanitize(out)}_{h}"


# ---------------------------------------------------------------- expression emitter

LeafFn = Callable[[int, int], str]  # (param index, lane) -> variable holding the loaded value


def emit_body(
    body: Expr,
    lanes: int,
    leaf_var: Callable[[str, int], str],
    fixed: dict[int, Sequence[str]] | None = None,
    indent: str = "    ",
    rotated_var: Callable[[str, int], str] | None = None,
) -> tuple[list[str], list[str]]:
    """Statements computing ``body`` for ``lanes`` independent elements, and the result vars.

    ``fixed`` maps ``id(expr)`` to per-lane variables already holding its value
    (the GEMM accumulator); ``rotated_var`` names a tensor's value read rotated (``RotateHalf``'s input).
    """
    fixed = dict(fixed or {})
    vars_of: dict[int, list[str]] = {k: list(v) for k, v in fixed.items()}
    lines: list[str] = []
    position = {id(e): j for j, e in enumerate(body.walk())}  # names stay those of the node's place in the body
    for e in nodes_to_emit(body, given=vars_of):
        j = position[id(e)]
        out = [f"t{j}_{lane}" for lane in range(lanes)]
        leaf = leaf_var
        if is_rotated(e):
            if rotated_var is None:
                raise CodegenError(f"RotateHalf {e.node!r}: this kernel form cannot read a rotated input")
            leaf = rotated_var
        for lane in range(lanes):
            args = [leaf(a.tensor, lane) if isinstance(a, Load) else vars_of[id(a)][lane] for a in e.args]
            lines.append(f"{indent}float {out[lane]} = {snippet(e, args)};")
        temps = op_def(e.op).probe_temps(e.attr_dict)
        if temps > 0:
            lines += _probe(out, temps, f"q{j}", indent)
        vars_of[id(e)] = out
    return lines, vars_of[id(body)]


def _probe(values: list[str], temps: int, tag: str, indent: str) -> list[str]:
    """C-05's fat probe: ``temps`` chained temporaries per lane, all live at once.

    The chain runs forward; the sink consumes it backwards and across lanes, so
    every temporary of every lane is live when the chain ends.  The value is
    unchanged unless the bounded sink equals 3e38, which it cannot reach.
    """
    lanes = len(values)
    lines = []
    for lane, v in enumerate(values):
        prev = v
        for t in range(temps):
            a = 1.0 - 1.0 / (64.0 + t)
            lines.append(f"{indent}float {tag}_{t}_{lane} = fmaf({prev}, {a!r}f, {0.001 * (t + 1)!r}f);")
            prev = f"{tag}_{t}_{lane}"
    for lane in range(lanes):
        lines.append(f"{indent}float {tag}_s_{lane} = 0.0f;")
    for t in reversed(range(temps)):
        for lane in range(lanes):
            other = (lane + 1) % lanes
            lines.append(
                f"{indent}{tag}_s_{lane} = fmaf({tag}_s_{lane}, 0.5f, {tag}_{t}_{lane} * {tag}_{t}_{other});"
            )
    for lane, v in enumerate(values):
        lines.append(f"{indent}{v} = ({tag}_s_{lane} == 3.0e38f) ? {tag}_s_{lane} : {v};")
    return lines


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
    name = kernel_name(KernelKind.ELEMENTWISE, k.out, _shape_salt(k, tensors))
    src = [PRELUDE, f'extern "C" __global__ void {name}({", ".join(params)}) {{']
    src.append(f"  const long long N = {n}LL;")
    src.append("  const long long stride = (long long)blockDim.x * gridDim.x;")
    src.append("  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;")
    group = math.prod(out_t.shape[1:]) if len(out_t.shape) == 3 else 0
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


def _shape_salt(k: Kernel, tensors: dict[str, TensorType]) -> str:
    """What makes two kernels writing the same tensor differ: body, shapes and dtypes."""
    shapes = ",".join(f"{t}:{tensors[t].shape}:{tensors[t].dtype}" for t in (*k.reads, k.out) if t in tensors)
    return shapes + json.dumps(expr_to_json(k.body), sort_keys=True)


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
    name = kernel_name(KernelKind.GEMM_EPILOGUE, k.out, _shape_salt(k, tensors))
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


#: threads per block of a row kernel (one thread per row)
ROW_BLOCK = 128


def row_kernel(k: Kernel, tensors: dict[str, TensorType]) -> CudaKernel:
    """A row kernel (a body with a row reduction or per-row values) as one thread per row, running the
    row's loops in turn: the same statements as the C backend's row kernel, one partial per reduction."""
    body = k.body
    out_t = tensors.get(k.out, body.type)
    leaves = loads(body)
    shapes = {t: tensors[t].shape for t in leaves}
    width = row_width(body, shapes)
    rows = math.prod(out_t.shape[:-1])
    levels = {t: row_level(shapes[t], width, rows, t, out_t.shape) for t in leaves}
    index = {t: i for i, t in enumerate(leaves)}

    def load(tensor: str, level: str) -> str:
        tile = int(out_t.shape[1]) if level == "group" else tile_rows(shapes[tensor])
        return row_read(level, width, tile,  # type: ignore[arg-type]
                        lambda at: TO_FLOAT[tensors[tensor].dtype].format(f"p{index[tensor]}[{at}]"), "LL")

    emitter = RowEmitter(width, levels.__getitem__, load, 1)
    lines = emitter.output(body, lambda value, at: f"out[{at}] = {FROM_FLOAT[out_t.dtype].format(value)};")
    params = [f"const {CTYPE[tensors[t].dtype]}* __restrict__ p{index[t]}" for t in leaves]
    params.append(f"{CTYPE[out_t.dtype]}* __restrict__ out")
    name = kernel_name(KernelKind.ELEMENTWISE, k.out, _shape_salt(k, tensors))
    src = [PRELUDE, f'extern "C" __global__ void {name}({", ".join(params)}) {{',
           "  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;",
           f"  if (r >= {rows}LL) return;", *(f"  {line}" for line in lines), "}"]
    grid = (max(1, -(-rows // ROW_BLOCK)), 1)
    return CudaKernel(name, KernelKind.ELEMENTWISE, "\n".join(src) + "\n", (*leaves, k.out), ROW_BLOCK, grid)


# ---------------------------------------------------------------- standalone kernels
# attention's layouts, batched products and the fused attention, each one thread per output element (or per
# query row) in a grid-stride loop: no shared memory, no barrier, the same arithmetic as the C backend's

STANDALONE_BLOCK = 128


def _grid_stride(total: int, lines: list[str]) -> list[str]:
    return [f"  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < {total}LL;",
            "       e += (long long)blockDim.x * gridDim.x) {", *(f"    {line}" for line in lines), "  }"]


def _layout_lines(body: Expr, shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[str]:
    """``out[e] = p0[source index]`` for Heads, Merge and GroupRepeat (see ``core.ops``: copies of the bits)."""
    a = body.attr_dict
    heads = int(a["heads"])
    if body.op == "Heads":
        seq, offset, width = int(a["seq"]), int(a["offset"]), int(a["width"])
        dh, cols = width // heads, shape[-1]
        return [f"const long long d = e % {dh}, s = (e / {dh}) % {seq}, g = e / {dh * seq};",
                f"out[e] = p0[((g / {heads}) * {seq} + s) * {cols} + {offset} + (g % {heads}) * {dh} + d];"]
    if body.op == "Merge":
        _, seq, d = shape
        return [f"const long long col = e % {heads * d}, row = e / {heads * d};",
                f"out[e] = p0[(((row / {seq}) * {heads} + col / {d}) * {seq} + row % {seq}) * {d} + col % {d}];"]
    group = math.prod(out_shape[1:])  # GroupRepeat: each output group copies input group g / heads
    return [f"out[e] = p0[(e / {group * heads}) * {group} + e % {group}];"]


def _product_lines(body: Expr, shapes: list[tuple[int, ...]], load: Callable[[int, str], str],
                   store: Callable[[str], str]) -> list[str]:
    """One element of a batched product: BatchScores (q @ k^T, causal: keys after the query are -inf) or
    BatchApply (p @ v), summed in fp32."""
    (g_, s_, k_), b_shape = shapes
    if body.op == "BatchScores":
        t_ = b_shape[1]
        causal = bool(body.attr_dict.get("causal", 0))
        head = [f"const long long t = e % {t_}, i = (e / {t_}) % {s_}, g = e / {s_ * t_};"]
        if causal:
            head.append(f"if (t > i) {{ {store('fp_neg_inf()')} continue; }}")
        a_at, b_at = f"(g * {s_} + i) * {k_} + x", f"(g * {t_} + t) * {k_} + x"
    else:
        n_ = b_shape[2]
        head = [f"const long long n = e % {n_}, i = (e / {n_}) % {s_}, g = e / {s_ * n_};"]
        a_at, b_at = f"(g * {s_} + i) * {k_} + x", f"(g * {k_} + x) * {n_} + n"
    return [*head, "float acc = 0.0f;", f"for (long long x = 0; x < {k_}; ++x) acc += {load(0, a_at)} * {load(1, b_at)};",
            store("acc")]


def _attention_lines(body: Expr, shapes: list[tuple[int, ...]], load: Callable[[int, str], str],
                     store_at: Callable[[str, str], str]) -> list[str]:
    """One query row of softmax(scale * q@k^T [+ mask]) @ v with an online softmax: the running max, sum and
    output are rescaled as the max grows; a key whose score is -inf (hidden) adds nothing, so a query whose
    every key is hidden gives 0/0 (NaN) as the unfused form does; a NaN score makes its row NaN."""
    (_, s_, d_), (_, t_, _), (_, _, e_) = shapes[:3]
    a = body.attr_dict
    scale, causal = float(a["scale"]), bool(a.get("causal", 0))
    mask = f" + {load(3, f'g * {t_} + j')}" if body.op == "MaskedAttention" else ""
    last = f"(i + 1 < {t_} ? i + 1 : {t_})" if causal else f"{t_}"
    return [f"const long long i = e % {s_}, g = e / {s_};",
            f"float acc[{e_}];", f"for (int c = 0; c < {e_}; ++c) acc[c] = 0.0f;",
            "float m = fp_neg_inf(), l = 0.0f;",
            f"for (long long j = 0; j < {last}; ++j) {{",
            "  float dot = 0.0f;",
            f"  for (long long x = 0; x < {d_}; ++x) dot += {load(0, f'(g * {s_} + i) * {d_} + x')} * "
            f"{load(1, f'(g * {t_} + j) * {d_} + x')};",
            f"  const float sc = {scale!r}f * dot{mask};",
            "  if (sc == fp_neg_inf()) continue;",
            "  const float mn = fp_max(m, sc), alpha = expf(m - mn), pj = expf(sc - mn);",
            "  l = l * alpha + pj;",
            f"  for (int c = 0; c < {e_}; ++c) acc[c] = acc[c] * alpha + pj * {load(2, f'(g * {t_} + j) * {e_} + c')};",
            "  m = mn;",
            "}",
            f"for (int c = 0; c < {e_}; ++c) {store_at(f'(g * {s_} + i) * {e_} + c', 'acc[c] / l')}"]


def standalone_kernel(k: Kernel, tensors: dict[str, TensorType]) -> CudaKernel:
    """A standalone kernel (one standalone op over loaded tensors) as CUDA."""
    body = k.body
    if not all(isinstance(a, Load) for a in body.args):
        raise CodegenError(f"standalone kernel {k.describe()} reads computed values: no CUDA form")
    ins = [a.tensor for a in body.args if isinstance(a, Load)]
    out_t = tensors.get(k.out, body.type)
    shapes = [tuple(tensors[t].shape) for t in ins]
    load = lambda i, at: TO_FLOAT[tensors[ins[i]].dtype].format(f"p{i}[{at}]")  # noqa: E731
    store_at = lambda at, v: f"out[{at}] = {FROM_FLOAT[out_t.dtype].format(v)};"  # noqa: E731
    if body.op in ("Heads", "Merge", "GroupRepeat"):
        total, lines = math.prod(out_t.shape), _layout_lines(body, shapes[0], tuple(out_t.shape))
    elif body.op in ("BatchScores", "BatchApply"):
        total, lines = math.prod(out_t.shape), _product_lines(body, shapes, load, lambda v: store_at("e", v))
    elif body.op in ("Attention", "MaskedAttention"):
        total, lines = math.prod(out_t.shape[:-1]), _attention_lines(body, shapes, load, store_at)
    else:
        raise CodegenError(f"standalone op {body.op} has no CUDA form")
    params = [f"const {CTYPE[tensors[t].dtype]}* __restrict__ p{i}" for i, t in enumerate(ins)]
    params.append(f"{CTYPE[out_t.dtype]}* __restrict__ out")
    name = kernel_name(KernelKind.STANDALONE, k.out, _shape_salt(k, tensors))
    src = [PRELUDE, f'extern "C" __global__ void {name}({", ".join(params)}) {{', *_grid_stride(total, lines), "}"]
    work = max(1, -(-total // STANDALONE_BLOCK))
    return CudaKernel(name, KernelKind.STANDALONE, "\n".join(src) + "\n", (*ins, k.out), STANDALONE_BLOCK,
                      (work, 1), grid_per_sm=8)


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

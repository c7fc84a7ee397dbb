"""A generated CUDA kernel (:class:`CudaKernel`: source, parameter order, launch shape), the CUDA prelude every
source starts with, and the expression emitter the generators share."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backends.codegen import (
    CodegenError,
    is_rotated,
    nodes_to_emit,
    snippet,
)
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
__host__ __device__ __forceinline__ float fp_exp(float x) { return expf(x); }
__host__ __device__ __forceinline__ float fp_round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__host__ __device__ __forceinline__ float fp_round_f16(float x) { return __half2float(__float2half_rn(x)); }
__host__ __device__ __forceinline__ float fp_bits_f32(unsigned int u) { union { unsigned int u; float f; } v = {u}; return v.f; }
__host__ __device__ __forceinline__ float fp_neg_inf() { return fp_bits_f32(0xff800000u); }
// an index outside its table (an Embedding id): the kernel stops with an error, never reads another row
__host__ __device__ __forceinline__ void fp_bad_index() {
#ifdef __CUDA_ARCH__
  __trap();
#else
  abort();
#endif
}
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
            lines += probe_lines(out, temps, f"q{j}", indent)
        vars_of[id(e)] = out
    return lines, vars_of[id(body)]


def probe_lines(values: list[str], temps: int, tag: str, indent: str) -> list[str]:
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


def shape_salt(k: Kernel, tensors: dict[str, TensorType]) -> str:
    """What makes two kernels writing the same tensor differ: body, shapes and dtypes."""
    shapes = ",".join(f"{t}:{tensors[t].shape}:{tensors[t].dtype}" for t in (*k.reads, k.out) if t in tensors)
    return shapes + json.dumps(expr_to_json(k.body), sort_keys=True)

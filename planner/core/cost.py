"""Device specs and the three-ledger kernel cost of seed K4.

A kernel's time is ``max(bytes / bandwidth, flops / peak) + launch``; when its
register sum exceeds the register limit its memory time is multiplied by
``spill_penalty``.  A plan's time and bytes are sums over kernels and its
register peak is the max over kernels.  ``docs/cost-model.md`` has the tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from planner.core.files import read_json
from planner.core.graph import Graph
from planner.core.kinds import KERNEL_OF_OP, KernelKind, OpKind
from planner.core.ops import OPS
from planner.core.schema import check_document


class DeviceSpecError(ValueError):
    """A device spec name or file is unknown or malformed."""


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bandwidth_gbps: float  # DRAM bandwidth, GB/s with GB = 1e9 bytes
    matmul_tflops: dict[str, float]  # peak GEMM FLOP/s per dtype (tensor cores), in TFLOP/s
    vector_tflops: float  # peak elementwise (fp32 CUDA-core) FLOP/s, in TFLOP/s
    launch_us: float
    reg_limit: int = 255
    spill_penalty: float = 3.0
    sm_count: int = 1
    regs_per_sm: int = 65536
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    #: fraction of peak GEMM throughput reached by each GEMM implementation
    gemm_efficiency: dict[str, float] = field(
        default_factory=lambda: {"cublaslt": 1.0, "custom": 1.0}
    )
    #: use registers measured from compiled kernels instead of op-table estimates
    measured_registers: bool = False
    #: shared memory per SM in bytes (occupancy of kernels that use shared memory)
    smem_per_sm: int = 233472
    #: the generated GEMM's output tile (rows = columns) per block (``backends.cupy.kernel.GEMM_TILE``, which a
    #: test keeps equal): a GEMM of fewer tiles than SMs keeps only that share of the device busy (0: not modelled)
    gemm_tile: int = 0
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def peak_matmul(self, dtype: str) -> float:
        try:
            return self.matmul_tflops[dtype] * 1e12
        except KeyError:
            raise DeviceSpecError(f"device {self.name!r} has no GEMM peak for dtype {dtype}") from None


BUILTIN_DEVICES: dict[str, DeviceSpec] = {
    # Exactly the parameters of seed 000, the K4 design note (docs/cost-model.md): one 40 TFLOP/s peak for all work.
    "seed-k4": DeviceSpec(
        name="seed-k4",
        bandwidth_gbps=448.0,
        matmul_tflops={"fp16": 40.0, "bf16": 40.0, "fp32": 40.0},
        vector_tflops=40.0,
        launch_us=5.0,
        reg_limit=255,
        spill_penalty=3.0,
        sm_count=46,
        regs_per_sm=65536,
        max_threads_per_sm=1536,
        max_blocks_per_sm=24,
        gemm_efficiency={"cublaslt": 1.0, "custom": 1.0},
        source="seed 000 (K4), docs/cost-model.md; SM figures are not used by its tables",
    ),
    # NVIDIA H200 SXM datasheet: 989 TFLOP/s dense FP16/BF16 tensor, 67 TFLOP/s FP32; Hopper (CC 9.0): 132 SMs,
    # 64K regs, 2048 threads, 32 blocks per SM. Measured on an H200 (docs/results/h200/calibration.json,
    # `fusion-planner calibrate --from-measured`): 4232 GB/s copy bandwidth (datasheet 4.8 TB/s), 3.95 us per
    # launch (assumed 3), cuBLAS fp16 at 0.72 of the peak (assumed 0.75); the generated wmma GEMM at 0.105
    # (assumed 0.4: [4] took 1329 us at 4096^3, docs/results/mlp_epilogue_h200.md).
    "h200": DeviceSpec(
        name="h200",
        bandwidth_gbps=4231.9,
        matmul_tflops={"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
        vector_tflops=67.0,
        launch_us=3.952,
        sm_count=132,
        regs_per_sm=65536,
        max_threads_per_sm=2048,
        max_blocks_per_sm=32,
        gemm_efficiency={"cublaslt": 0.721, "custom": 0.105},
        measured_registers=True,
        gemm_tile=128,
        source="NVIDIA H200 Tensor Core GPU datasheet; CUDA C Programming Guide table for CC 9.0; bandwidth, launch "
               "and GEMM efficiencies measured on an H200 on 2026-12-04 (docs/results/h200)",
    ),
    # NVIDIA RTX Blackwell GPU architecture whitepaper (GeForce RTX 5090): 1792 GB/s GDDR7,
    # 209.5 TFLOP/s dense FP16 tensor with FP32 accumulate, 104.8 TFLOP/s FP32;
    # CC 12.0: 170 SMs, 64K regs, 1536 threads, 24 blocks per SM.
    "rtx5090": DeviceSpec(
        name="rtx5090",
        bandwidth_gbps=1792.0,
        matmul_tflops={"fp16": 209.5, "bf16": 209.5, "fp32": 104.8},
        vector_tflops=104.8,
        launch_us=3.0,
        sm_count=170,
        regs_per_sm=65536,
        max_threads_per_sm=1536,
        max_blocks_per_sm=24,
        smem_per_sm=102400,
        gemm_efficiency={"cublaslt": 0.75, "custom": 0.4},
        measured_registers=True,
        gemm_tile=128,
        source="NVIDIA RTX Blackwell architecture whitepaper; CUDA C Programming Guide, CC 12.0",
    ),
}

DEFAULT_DEVICE = "h200"


def load_device(name_or_file: str | None) -> DeviceSpec:
    """A built-in spec by name, or a JSON spec file (as written by ``calibrate``)."""
    key = name_or_file or DEFAULT_DEVICE
    if key in BUILTIN_DEVICES:
        return BUILTIN_DEVICES[key]
    p = Path(key)
    if not p.exists():
        raise DeviceSpecError(
            f"unknown device {key!r}: not a built-in ({', '.join(BUILTIN_DEVICES)}) and no such file"
        )
    if not p.is_file():
        raise DeviceSpecError(f"device {key!r}: {p} is not a regular file")
    return device_from_json(read_json(p, DeviceSpecError, "device file", limit=2**20), str(p))


def device_from_json(data: Any, source: str = "<json>") -> DeviceSpec:
    """A DeviceSpec from a parsed device file, checked against its schema (``planner/core/schemas/device.json``)."""
    check_document(data, "device", f"device file {source}", DeviceSpecError)
    return DeviceSpec(**data)


# ---------------------------------------------------------------- ledgers


@dataclass(frozen=True)
class KernelCost:
    """The three ledgers of one kernel and its estimated time."""

    bytes: int
    gemm_flops: float
    ew_flops: float
    regs: int
    spills: bool
    mem_us: float
    compute_us: float
    est_us: float
    launches: int = 1

    @property
    def flops(self) -> float:
        return self.gemm_flops + self.ew_flops


def gemm_busy_share(spec: DeviceSpec, out_shape: Sequence[int]) -> float:
    """The share of the device a generated GEMM keeps busy: one block per output tile, at most one SM each
    (measured on the H200: the wmma kernel at M=16, N=4096 has 32 tiles for 132 SMs and took 265 us, 26 times
    the estimate that filled the device)."""
    if not spec.gemm_tile or len(out_shape) < 2:
        return 1.0
    rows = math.prod(int(d) for d in out_shape[:-1])
    tiles = -(-rows // spec.gemm_tile) * -(-int(out_shape[-1]) // spec.gemm_tile)
    return min(1.0, tiles / spec.sm_count)


def kernel_cost(
    spec: DeviceSpec,
    *,
    kind: str,
    dtype: str,
    nbytes: int,
    gemm_flops: float,
    ew_flops: float,
    regs: int,
    spills: bool | None = None,
    out_shape: Sequence[int] = (),
) -> KernelCost:
    """Seed K4's kernel time: ``max(bytes/bw, flops/peak) + launch`` with the spill cliff.

    ``spills`` overrides the register-sum test when a compiled kernel's spill
    count is known (measured registers never exceed the hardware limit). ``out_shape``: a generated GEMM's
    output, whose tiles (``spec.gemm_tile``) may be fewer than the device's SMs.
    """
    busy = gemm_busy_share(spec, out_shape) if kind == KernelKind.GEMM_EPILOGUE else 1.0
    mem_us = nbytes / (spec.bandwidth_gbps * 1e9) * 1e6 / busy
    impl = "cublaslt" if kind == KernelKind.CUBLASLT else "custom"
    compute_s = 0.0
    if gemm_flops:
        compute_s += gemm_flops / (spec.peak_matmul(dtype) * spec.gemm_efficiency.get(impl, 1.0) * busy)
    compute_s += ew_flops / (spec.vector_tflops * 1e12)
    compute_us = compute_s * 1e6
    # A library GEMM's register use is the library's business: never costed as spilling.
    if spills is None:
        spills = regs > spec.reg_limit
    spills = kind != KernelKind.CUBLASLT and spills
    if spills:
        mem_us *= spec.spill_penalty
    est = max(mem_us, compute_us) + spec.launch_us
    return KernelCost(nbytes, gemm_flops, ew_flops, regs, spills, mem_us, compute_us, est)


def unfused_estimate_us(graph: Graph, spec: DeviceSpec) -> float:
    """The cost model's time of ``graph`` run one op per kernel, reckoned from the graph alone (the extractor's
    unfused plan costs the same kernels): what a region's share of a whole model is estimated by."""
    total = 0.0
    for n in graph.ops:
        opd = OPS[n.op]
        ins = [graph[x].type for x in n.inputs]
        nbytes = n.type.nbytes + sum(opd.read_bytes(i, t.nbytes, n.type.nbytes) for i, t in enumerate(ins))
        flops = opd.flops(n.type.shape, [t.shape for t in ins], n.attr_dict)
        gemm, ew = (flops, 0.0) if opd.kind in (OpKind.MATMUL, OpKind.STANDALONE) else (0.0, flops)
        total += kernel_cost(spec, kind=KERNEL_OF_OP.get(opd.kind, KernelKind.ELEMENTWISE), dtype=n.type.dtype,
                             nbytes=nbytes, gemm_flops=gemm, ew_flops=ew, regs=opd.live_regs(n.attr_dict),
                             out_shape=n.type.shape).est_us
    return total

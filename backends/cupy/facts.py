"""Kernel facts without a GPU: nvcc resource usage and analytic occupancy.

``nvcc_facts(kernel)`` compiles a generated kernel with
``nvcc -arch=sm_90 -cubin --resource-usage`` (cached by source hash and nvcc
version) and parses registers per thread, spill stores and the stack frame
(local memory).  ``occupancy(spec, regs, block, smem)`` computes resident blocks
per SM as the CUDA occupancy calculator does.  ``annotate_candidates`` puts
these facts on every generated kernel of a candidate set and, when the device
spec asks for measured registers, re-costs the kernel with them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from backends import process
from backends.cupy.codegen import CodegenError, generate
from backends.cupy.kernel import CudaKernel
from planner.core.cost import DeviceSpec, kernel_cost
from planner.core.plans import Kernel, Plan

log = logging.getLogger(__name__)

ARCH = "sm_90"
#: registers are allocated per warp in units of this many (CC 7.0 - 12.x)
REG_ALLOC_UNIT = 256
#: per-thread register counts are rounded up to a multiple of this
REG_GRANULE = 8
#: shared memory the system reserves per resident block (CC >= 8.0)
SMEM_RESERVED_PER_BLOCK = 1024


class NvccError(RuntimeError):
    """nvcc is missing or rejected a generated kernel; the message names the kernel."""


@dataclass(frozen=True)
class Resources:
    regs: int
    spill_bytes: int  # spill stores to local memory
    local_bytes: int  # stack frame (local memory) per thread
    smem_bytes: int  # static shared memory per block

    def to_json(self) -> dict[str, int]:
        return {
            "regs": self.regs,
            "spill_bytes": self.spill_bytes,
            "local_bytes": self.local_bytes,
            "smem_bytes": self.smem_bytes,
        }


def cache_dir() -> Path:
    root = os.environ.get("FUSION_PLANNER_CACHE") or os.path.join(Path.home(), ".cache", "fusion-planner")
    return Path(root) / "nvcc"


@functools.lru_cache(maxsize=1)
def nvcc_version() -> str:
    exe = shutil.which("nvcc")
    if exe is None:
        raise NvccError("nvcc is not on PATH")
    done = process.run([exe, "--version"], 60.0, "nvcc --version", NvccError)
    if done.returncode != 0:
        raise NvccError(f"nvcc --version failed: {done.stderr.strip()[:300]}")
    out = done.stdout
    return out.strip().splitlines()[-1]


def nvcc_available() -> bool:
    try:
        nvcc_version()
    except (NvccError, OSError):
        return False
    return True


_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SPILL = re.compile(r"(\d+) bytes spill stores")
_RE_STACK = re.compile(r"(\d+) bytes stack frame")
_RE_SMEM = re.compile(r"(\d+) bytes smem")


def parse_resource_usage(text: str, name: str) -> Resources:
    """Facts for entry ``name`` from ptxas' ``--resource-usage`` report."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if name in line and "Function properties" in line), None)
    if start is None:
        start = next((i for i, line in enumerate(lines) if name in line), None)
    if start is None:
        raise NvccError(f"nvcc report has no entry for kernel {name}")
    chunk = "\n".join(lines[start : start + 6])
    regs = _RE_REGS.search(chunk)
    if regs is None:
        raise NvccError(f"nvcc report for kernel {name} lists no register count:\n{chunk}")
    spill, stack, smem = (_RE_SPILL.search(chunk), _RE_STACK.search(chunk), _RE_SMEM.search(chunk))
    return Resources(
        regs=int(regs.group(1)),
        spill_bytes=int(spill.group(1)) if spill else 0,
        local_bytes=int(stack.group(1)) if stack else 0,
        smem_bytes=int(smem.group(1)) if smem else 0,
    )


def _cache_key(kernel: CudaKernel, arch: str) -> Path:
    key = hashlib.sha256(f"{nvcc_version()}\n{arch}\n{kernel.source}".encode()).hexdigest()[:24]
    return cache_dir() / f"{key}.json"


def compile_many(kernels: list[CudaKernel], arch: str = ARCH) -> list[Resources]:
    """Resources of each kernel; the uncached ones compiled together in one nvcc run."""
    found: dict[str, Resources] = {}
    todo: dict[str, CudaKernel] = {}
    for k in kernels:
        path = _cache_key(k, arch)
        if path.exists():
            found[k.name] = Resources(**json.loads(path.read_text()))
        else:
            todo[k.name] = k
    if todo:
        report = _run_nvcc("\n".join(k.source for k in todo.values()), arch, ", ".join(todo))
        for name, k in todo.items():
            res = parse_resource_usage(report, name)
            path = _cache_key(k, arch)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(res.to_json()))
            found[name] = res
    return [found[k.name] for k in kernels]


def compile_resources(kernel: CudaKernel, arch: str = ARCH) -> Resources:
    """Compile with nvcc (once per source, nvcc version and arch) and parse its resource usage."""
    return compile_many([kernel], arch)[0]


def _run_nvcc(source: str, arch: str, names: str) -> str:
    with tempfile.TemporaryDirectory(prefix="fp-nvcc-") as tmp:
        src = Path(tmp) / "k.cu"
        src.write_text(source)
        cmd = ["nvcc", f"-arch={arch}", "-cubin", "--resource-usage", "-o", str(Path(tmp) / "k.cubin"), str(src)]
        proc = process.run(cmd, 600.0, f"nvcc on kernel(s) {names[:200]}", NvccError)
    if proc.returncode != 0:
        raise NvccError(f"nvcc rejected kernel(s) {names[:300]}:\n{proc.stderr.strip()[:2000]}")
    log.debug("nvcc compiled %s", names)
    return proc.stdout + "\n" + proc.stderr


def occupancy(spec: DeviceSpec, regs: int, block: int, smem_bytes: int = 0) -> int:
    """Resident blocks per SM, limited by registers, threads, blocks and shared memory."""
    warps = -(-block // 32)
    regs_per_warp = -(-max(regs, 1) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = (spec.regs_per_sm // regs_per_warp) // warps
    by_threads = spec.max_threads_per_sm // (warps * 32)
    limits = [by_regs, by_threads, spec.max_blocks_per_sm]
    if smem_bytes:
        limits.append(spec.smem_per_sm // (smem_bytes + SMEM_RESERVED_PER_BLOCK))
    return max(0, min(limits))


def kernel_facts(spec: DeviceSpec, cuda: CudaKernel, res: Resources, source: str) -> dict[str, Any]:
    return {
        "regs": res.regs,
        "spill_bytes": res.spill_bytes,
        "local_bytes": res.local_bytes,
        "occupancy": occupancy(spec, res.regs, cuda.block, res.smem_bytes),
        "block": cuda.block,
        "facts_from": source,
    }


def with_facts(spec: DeviceSpec, k: Kernel, facts: dict[str, Any]) -> Kernel:
    """The kernel carrying ``facts``; re-costed with measured registers when the spec asks."""
    cost = k.cost
    if spec.measured_registers:
        cost = kernel_cost(
            spec,
            kind=k.kind,
            dtype=k.body.type.dtype,
            nbytes=k.cost.bytes,
            gemm_flops=k.cost.gemm_flops,
            ew_flops=k.cost.ew_flops,
            regs=int(facts["regs"]),
            spills=int(facts["spill_bytes"]) > 0,
            out_shape=k.body.type.shape,
        )
    return replace(k, cost=cost, facts=dict(facts))


def _generated(plan: Plan) -> list[CudaKernel | None]:
    out: list[CudaKernel | None] = []
    for k in plan.kernels:
        try:
            out.append(generate(k, plan.tensors))
        except CodegenError as exc:
            log.info("no generated CUDA for %s: %s", k.describe(), exc)
            out.append(None)
    return out


def annotate_plans(spec: DeviceSpec, plans: list[Plan], arch: str = ARCH) -> list[Plan]:
    """Every generated kernel of ``plans`` compiled (one nvcc run) and its facts attached."""
    gen = [_generated(p) for p in plans]
    unique = {c.digest: c for g in gen for c in g if c is not None}
    res = dict(zip(unique, compile_many(list(unique.values()), arch), strict=True))
    out = []
    for p, g in zip(plans, gen, strict=True):
        kernels = tuple(
            k if c is None else with_facts(spec, k, kernel_facts(spec, c, res[c.digest], f"nvcc -arch={arch}"))
            for k, c in zip(p.kernels, g, strict=True)
        )
        out.append(replace(p, kernels=kernels))
    return out


def plan_with_facts(spec: DeviceSpec, plan: Plan, facts: list[dict[str, Any]]) -> Plan:
    """``plan`` with per-kernel facts from a compiled plan (``CompiledPlan.kernel_facts``, GPU).

    Library kernels (no ``regs``) keep their cost; the others are re-costed with
    the measured registers where the spec asks (``with_facts``).
    """
    if len(facts) != len(plan.kernels):
        raise ValueError(f"{len(facts)} fact records for {len(plan.kernels)} kernels of {plan.notation()}")
    kernels = tuple(k if "regs" not in f else with_facts(spec, k, f) for k, f in zip(plan.kernels, facts, strict=True))
    return replace(plan, kernels=kernels)


def annotate_plan(spec: DeviceSpec, plan: Plan, arch: str = ARCH) -> Plan:
    return annotate_plans(spec, [plan], arch)[0]


def annotate_candidates(cands: Any, arch: str = ARCH) -> Any:
    """Annotate (and, for measured-register specs, re-cost and re-sort) a CandidateSet's plans in place."""
    cands.plans = sorted(annotate_plans(cands.spec, list(cands.plans), arch), key=Plan.sort_key)
    return cands


def facts_column(plan: Plan) -> str:
    """Per-kernel ``regs/spill_bytes/blocks-per-SM`` (``lib`` for library kernels)."""
    cells = []
    for k in plan.kernels:
        f = k.facts
        cells.append(f"{f['regs']}/{f['spill_bytes']}/{f['occupancy']}" if "regs" in f else "lib")
    return " ".join(cells)

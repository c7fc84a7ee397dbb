"""The generated-C CPU backend (``backend``), its code generator (``codegen``), the GEMM library (``gemm``),
the worker pools and calibration; registered as the ``cpu`` backend plugin."""

from __future__ import annotations

import argparse
import os
import shutil

from backends.cpu.backend import CpuBackend
from backends.cpu.calibrate import calibrate_cpu, machine_spec, record_machine_spec
from backends.cpu.compiler import CompilerUnavailable
from backends.cpu.stream_probe import forget_verdicts
from planner.backend import BackendPlugin, BackendUnavailable, Calibration
from planner.core.cost import DeviceSpec
from planner.core.errors import UsageError


def compiler_found() -> bool:
    """Is the C compiler (``$CC``, else ``cc``) on PATH?"""
    return shutil.which(os.environ.get("CC", "cc")) is not None


def _calibration_args(parser: argparse.ArgumentParser) -> None:
    """The cpu calibration takes only the shared --name and --output."""


def calibrate(args: argparse.Namespace) -> tuple[DeviceSpec, str]:
    """Measure this machine: triad bandwidth, an empty kernel's call, GEMM and vector FLOP/s; the result also
    becomes the spec a cpu search is costed with by default (``machine_spec``).  The kept streaming-store verdicts
    are dropped, to be measured again as plans need them (``stream_probe``)."""
    try:
        cal = calibrate_cpu()
    except (CompilerUnavailable, BackendUnavailable) as exc:
        raise UsageError(f"calibrate: {exc}") from None
    gemm = "  ".join(f"{n}^3 {g:.1f}" for n, g in cal.gemm_gflops.items())
    line = (f"triad {cal.triad_gbps:.2f} GB/s | empty kernel {cal.launch_us:.3f} us | GEMM GFLOP/s {gemm} "
            f"(row-tiled {cal.tiled_gemm_gflops:.1f}) | vector {cal.vector_gflops:.2f} GFLOP/s | {cal.seconds:.1f} s")
    record_machine_spec(cal.spec())
    machine_spec.cache_clear()
    forget_verdicts()
    return cal.spec(args.name or "cpu-calibrated"), line


PLUGIN = BackendPlugin(
    "cpu", CpuBackend, "generated C kernels, the GEMM library and a native worker pool on this machine's cores",
    options=frozenset({"threads"}), auto_rank=1, usable=compiler_found,
    calibration=Calibration(_calibration_args, calibrate), default_device=machine_spec,
)

__all__ = ["PLUGIN", "CpuBackend", "compiler_found"]

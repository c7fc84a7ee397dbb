"""Generated kernels compiled as cupy compiles them on the device, with no GPU needed: NVRTC under cupy's options.

``cupy.RawKernel`` hands NVRTC the options of :func:`nvrtc_options`: ``assemble_cupy_compiler_options`` (cupy's
CCCL and own include folders, then the pip CUDA runtime's ``nvidia/cu13/include``), then ``-ftz=true``,
``-arch=sm_XX`` and ``--device-as-default-execution-space`` (``cupy/cuda/compiler.py``, cupy 14.2; a test checks
the assembly against cupy's own path).  Compiling here through that path, with the headers the device has, is
what catches a kernel the device cannot build before any device time is spent.

The pip runtime headers lack ``crt/`` (``mma.h`` includes ``crt/mma.h``), which ships in its own wheel,
``nvidia-cuda-crt``.  The device image has no such wheel; the suite carries it and installs it into a folder of
its own, so :func:`compile_options` adds that folder when cupy's include folders lack ``crt/mma.h``.  CI installs
the same wheel (the ``test`` extra) and compiles through the same function.

Only imported where cupy is installed (a GPU is not needed).
"""

from __future__ import annotations

import functools
import io
import os
import re
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from backends.cupy.facts import NvccError, Resources, parse_resource_usage
from backends.cupy.kernel import CudaKernel
from planner.backend import BackendUnavailable

try:
    from cupy._core import core as _cupy_core
    from cupy.cuda import compiler as _cupy_compiler
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise BackendUnavailable(f"compiling with NVRTC needs cupy: {exc}") from None

#: the options the project passes to ``cupy.RawKernel`` (cupy adds its own around them)
BASE_OPTIONS = ("--std=c++17",)
#: the device's architecture (H200: compute capability 9.0)
ARCH = "90"
#: most kernels in one NVRTC program: a program per kernel costs a header parse each (about 0.1 s with mma.h)
BATCH = 24
#: a register count this far from nvcc's is flagged
REGS_TOLERANCE = 4
CRT_HEADER = Path("crt") / "mma.h"


class NvrtcError(RuntimeError):
    """NVRTC rejected a generated kernel; the message names the kernel and quotes the compiler."""


def nvrtc_version() -> tuple[int, int]:
    major, minor = _cupy_compiler._get_nvrtc_version()
    return int(major), int(minor)


def _include_dirs(options: Iterable[str]) -> list[str]:
    return [o[2:] for o in options if o.startswith("-I")]


def crt_include_dirs(search: Sequence[str] | None = None, major: int | None = None) -> list[str]:
    """Folders ``nvidia/cu<major>/include`` on the import path that hold ``crt/mma.h`` (the ``nvidia-cuda-crt``
    wheel, wherever pip put it)."""
    major = nvrtc_version()[0] if major is None else major
    found = []
    for root in sys.path if search is None else search:
        inc = Path(root or ".") / "nvidia" / f"cu{major}" / "include"
        if (inc / CRT_HEADER).is_file():
            found.append(str(inc))
    return list(dict.fromkeys(found))


@functools.lru_cache(maxsize=1)
def compile_options() -> tuple[str, ...]:
    """What the project passes to ``cupy.RawKernel``: the base options, plus the folder of ``crt/mma.h`` when
    cupy's own include folders lack it."""
    cupy_dirs = _include_dirs(_cupy_core.assemble_cupy_compiler_options(()))
    if any((Path(d) / CRT_HEADER).is_file() for d in cupy_dirs):
        return BASE_OPTIONS
    extra = [d for d in crt_include_dirs() if d not in cupy_dirs]
    return BASE_OPTIONS + tuple(f"-I{d}" for d in extra[:1])


def nvrtc_options(arch: str = ARCH) -> tuple[str, ...]:
    """Exactly the options ``cupy.RawKernel`` compiles a kernel of ours with, on a device of ``arch``."""
    opts = tuple(_cupy_core.assemble_cupy_compiler_options(compile_options()))
    opts += ("-ftz=true", f"-arch=sm_{arch}", "--device-as-default-execution-space")
    if nvrtc_version() >= (12, 8) and _cupy_compiler._use_pch:
        opts += ("--pch",)
    return opts


@dataclass(frozen=True)
class HeaderReport:
    include_dirs: tuple[str, ...]
    crt_dir: str | None  # where crt/mma.h was found, None if nowhere

    @property
    def ok(self) -> bool:
        return self.crt_dir is not None

    def describe(self) -> str:
        where = self.crt_dir or "nowhere: install the nvidia-cuda-crt wheel matching nvidia-cuda-runtime"
        return f"crt/mma.h in {where}; include folders: {', '.join(self.include_dirs)}"


def header_report(arch: str = ARCH) -> HeaderReport:
    dirs = tuple(_include_dirs(nvrtc_options(arch)))
    crt = next((d for d in dirs if (Path(d) / CRT_HEADER).is_file()), None)
    return HeaderReport(dirs, crt)


def _compile(source: str, options: tuple[str, ...], names: str) -> str:
    log = io.StringIO()
    prog = _cupy_compiler._NVRTCProgram(source, "planner.cu", (), (), name_expressions=None, method="cubin")
    try:
        prog.compile(options + ("-Xptxas", "-v"), log)
    except _cupy_compiler.CompileException as exc:
        raise NvrtcError(f"NVRTC rejected kernel(s) {names[:300]}:\n{str(exc).strip()[:2000]}") from None
    return log.getvalue()


def compile_each(kernels: Sequence[CudaKernel], arch: str = ARCH) -> list[Resources | NvrtcError]:
    """Each kernel compiled by NVRTC under :func:`nvrtc_options`, with ptxas' report of its resources, or the
    error that names it.  Kernels go in programs of up to :data:`BATCH`, compiled on every core (ptxas reports
    each entry on its own, as for a program of one); a program NVRTC rejects is compiled again kernel by kernel."""
    options = nvrtc_options(arch)
    unique = list({k.digest: k for k in kernels}.values())
    size = max(1, min(BATCH, -(-len(unique) // (os.cpu_count() or 1))))
    batches = [unique[i : i + size] for i in range(0, len(unique), size)]
    found: dict[str, Resources | NvrtcError] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(len(batches), os.cpu_count() or 1))) as pool:
        for part in pool.map(lambda b: _compile_batch(b, options), batches):
            found.update(part)
    return [found[k.digest] for k in kernels]


def _compile_batch(batch: Sequence[CudaKernel], options: tuple[str, ...]) -> dict[str, Resources | NvrtcError]:
    try:
        report = _compile("\n".join(k.source for k in batch), options, ", ".join(k.name for k in batch))
    except NvrtcError:
        out: dict[str, Resources | NvrtcError] = {}
        for k in batch:
            try:
                out[k.digest] = _resources(_compile(k.source, options, k.name), k.name)
            except NvrtcError as exc:
                out[k.digest] = exc
        return out
    return {k.digest: _resources(report, k.name) for k in batch}


def compile_kernels(kernels: Sequence[CudaKernel], arch: str = ARCH) -> list[Resources]:
    """:func:`compile_each`, raising the first kernel's error."""
    out = []
    for r in compile_each(kernels, arch):
        if isinstance(r, NvrtcError):
            raise r
        out.append(r)
    return out


def _resources(report: str, name: str) -> Resources:
    try:
        return parse_resource_usage(report, name)
    except NvccError as exc:
        raise NvrtcError(str(exc).replace("nvcc report", "NVRTC's ptxas report")) from None


@dataclass(frozen=True)
class Comparison:
    kernel: str
    nvrtc: Resources
    nvcc: Resources | None  # None where nvcc is not installed

    @property
    def regs_delta(self) -> int | None:
        return None if self.nvcc is None else self.nvrtc.regs - self.nvcc.regs

    @property
    def flagged(self) -> bool:
        d = self.regs_delta
        spills_differ = self.nvcc is not None and (self.nvrtc.spill_bytes > 0) != (self.nvcc.spill_bytes > 0)
        return (d is not None and abs(d) > REGS_TOLERANCE) or spills_differ


_RE_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def comparison_table(rows: Sequence[Comparison]) -> str:
    """Markdown: each kernel's registers and spills under NVRTC and under nvcc, flagged past the tolerance."""
    out = ["| kernel | NVRTC regs | nvcc regs | delta | NVRTC spill B | nvcc spill B | flag |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        nv = r.nvcc
        out.append(
            f"| {_RE_SAFE.sub('_', r.kernel)} | {r.nvrtc.regs} | {'-' if nv is None else nv.regs} | "
            f"{'-' if r.regs_delta is None else f'{r.regs_delta:+d}'} | {r.nvrtc.spill_bytes} | "
            f"{'-' if nv is None else nv.spill_bytes} | {'**differs**' if r.flagged else ''} |"
        )
    return "\n".join(out)

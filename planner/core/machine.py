"""What machine a measurement ran on, and which of its vector units this project's code may use (standard library
only, as planner.core.env is: the remote runner uses it)."""

from __future__ import annotations

import os
import platform

from planner.core.env import env_choice

#: ``avx2``: compile and choose kernels as on a machine without AVX-512 or AMX, where the CPU has them
ISA_ENV = "FUSION_PLANNER_CPU_ISA"
ISA_CHOICES = ("native", "avx2")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def isa(flags: set[str]) -> str:
    """The vector units that decide how this project's kernels run: AVX2, AVX-512 (with BF16), AMX."""
    if "avx512f" in flags:
        vec = "AVX-512" + (" with BF16" if "avx512_bf16" in flags else "")
    elif "avx2" in flags:
        vec = "AVX2, no AVX-512"
    elif flags:
        vec = "no AVX2"
    else:
        return "ISA unknown"
    amx = "AMX" if {"amx_tile", "amx_bf16"} <= flags else "no AMX"
    return f"{vec}, {amx}"


def target_isa() -> str:
    """``native`` (the CPU's own vector units) or ``avx2`` (``$FUSION_PLANNER_CPU_ISA``): the code an AVX2-only
    machine runs, on a CPU that also has AVX-512 or AMX, to test and measure that machine's kernels and choices."""
    return env_choice(ISA_ENV, ISA_CHOICES, "native")


def cpu_model() -> str:
    """The CPU's model name, family and model, and vector ISA, from /proc/cpuinfo (else what ``platform``
    knows): two machines sold under one name (a VM's "AMD EPYC") can differ in what decides a kernel's speed."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or "unknown CPU"
    ident = f"family {info['cpu family']} model {info['model']}" if "cpu family" in info and "model" in info else ""
    features = isa(set(info.get("flags", "").split())) if info else ""
    narrowed = "code narrowed to AVX2" if target_isa() == "avx2" else ""
    details = "; ".join(d for d in (ident, features, narrowed) if d)
    return f"{name} ({details})" if details else name


def describe() -> str:
    """One line for a results file: architecture, cores, CPU model and ISA, Python version."""
    return f"{platform.machine()}, {os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}"

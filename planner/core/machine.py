"""What machine a measurement ran on (standard library only: the remote runner uses it)."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe() -> str:
    """One line for a results file: architecture, cores, CPU model, Python version."""
    return f"{platform.machine()}, {os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}"

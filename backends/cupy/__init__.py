"""The CUDA backend: generated fused kernels (cupy RawKernel), cuBLASLt epilogues, remote timing; registered as
the ``cupy`` backend plugin with its commands (``export-candidates``, ``bench c05``), the ``explain
--kernel-facts`` column and ``calibrate --from-measured``.

Importing this package needs neither cupy nor a GPU; ``CupyBackend.compile`` raises ``BackendUnavailable``
where they are missing.  See docs/gpu.md.
"""

from __future__ import annotations

import importlib.util

from backends.cupy.backend import CupyBackend
from backends.cupy.commands import COMMANDS, FROM_MEASURED, KERNEL_FACTS
from planner.backend import BackendPlugin


def gpu_present() -> bool:
    """Does cupy see a CUDA device here?"""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # cupy without a driver or a device: not a GPU machine
        return False


PLUGIN = BackendPlugin(
    "cupy", CupyBackend, "generated CUDA kernels and cuBLASLt epilogues through cupy (NVRTC) on a GPU",
    auto_rank=0, usable=gpu_present, commands=COMMANDS, explain_columns=(KERNEL_FACTS,), calibration=FROM_MEASURED,
    worker_device="gpu",
)

__all__ = ["PLUGIN", "CupyBackend", "gpu_present"]

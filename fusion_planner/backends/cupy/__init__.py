"""The CUDA backend: generated fused kernels (cupy RawKernel), cuBLASLt epilogues, remote timing.

Importing this package needs neither cupy nor a GPU; ``CupyBackend.compile``
raises ``BackendUnavailable`` where they are missing.  See docs/gpu.md.
"""

from fusion_planner.backends.cupy.backend import CupyBackend

__all__ = ["CupyBackend"]

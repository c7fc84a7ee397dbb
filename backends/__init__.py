"""Deprecated alias: the backends live in ``fusion_planner.backends`` now.

``python -m backends.cupy`` and the old module paths (``backends.reference``,
``backends.cpu``, ...) keep working, with a DeprecationWarning, until release 0.3.
"""

from __future__ import annotations

import sys
import warnings

from planner import _Alias

warnings.warn(
    "the 'backends' package is now 'fusion_planner.backends'; 'backends' keeps working until release 0.3",
    DeprecationWarning,
    stacklevel=2,
)

#: old module name -> the module it is now
MOVED: dict[str, str] = {
    "backends.codegen_c": "fusion_planner.backends.cpu.codegen",
    "backends.cpu": "fusion_planner.backends.cpu.backend",
    "backends.reference_backend": "fusion_planner.backends.reference_backend",
    "backends.reference": "fusion_planner.backends.reference",
    "backends.model": "fusion_planner.backends.model",
    "backends.measured": "fusion_planner.backends.measured",
    "backends.base": "fusion_planner.backends.base",
    "backends.cupy.backend": "fusion_planner.backends.cupy.backend",
    "backends.cupy.bundle": "fusion_planner.backends.cupy.bundle",
    "backends.cupy.c05": "fusion_planner.backends.cupy.c05",
    "backends.cupy.codegen": "fusion_planner.backends.cupy.codegen",
    "backends.cupy.facts": "fusion_planner.backends.cupy.facts",
    "backends.cupy.gpu": "fusion_planner.backends.cupy.gpu",
    "backends.cupy.runner": "fusion_planner.backends.cupy.runner",
    "backends.cupy.verify": "fusion_planner.backends.cupy.verify",
}
sys.meta_path.insert(0, _Alias(MOVED))

from fusion_planner.backends import BACKENDS, get_backend  # noqa: E402

__all__ = ["BACKENDS", "get_backend"]

"""Backends that execute plans: reference (numpy), model (cost model), cpu (generated C), cupy (GPU).

``get_backend(name, spec)`` imports a backend lazily, so a machine without a
C compiler or a GPU can still use the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fusion_planner.core.errors import UsageError

if TYPE_CHECKING:
    from fusion_planner.backends.base import Backend
    from fusion_planner.core.cost import DeviceSpec

#: backend name -> "module:Class"
BACKENDS: dict[str, str] = {
    "reference": "fusion_planner.backends.reference_backend:ReferenceBackend",
    "model": "fusion_planner.backends.model:ModelBackend",
    "cpu": "fusion_planner.backends.cpu.backend:CpuBackend",
    "cupy": "fusion_planner.backends.cupy:CupyBackend",
}


#: backends that run on a thread count of their own choosing
THREADED = ("cpu",)


def get_backend(name: str, spec: DeviceSpec, *, threads: int | None = None) -> Backend:
    """The backend ``name``; ``threads`` (cpu only; None: its default, every available core)."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if threads is not None and name not in THREADED:
        raise UsageError(f"a thread count applies to the {', '.join(THREADED)} backend, not {name!r}")
    module, cls = BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module), cls)
    return backend_cls(spec) if threads is None else backend_cls(spec, threads=threads)

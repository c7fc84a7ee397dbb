"""Deprecated alias: the code lives in the packages ``planner``, ``backends`` and ``rewrite_rules`` now.

``import fusion_planner``, ``fusion_planner.plan(...)`` and the old module paths
(``fusion_planner.core.graph``, ``fusion_planner.backends.cpu.backend``, ...) keep working, with a
DeprecationWarning, until release 0.3, which removes them. Each old module name is the new module
itself, not a copy.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

from planner import plan

warnings.warn(
    "the 'fusion_planner' package is now 'planner' (with 'backends' and 'rewrite_rules'); 'fusion_planner' keeps "
    "working until release 0.3",
    DeprecationWarning,
    stacklevel=2,
)

#: old module prefixes and where they went, most specific first
MOVED: tuple[tuple[str, str], ...] = (
    ("fusion_planner.backends.reference_backend", "backends.reference"),
    ("fusion_planner.backends.reference", "planner.core.reference"),
    ("fusion_planner.backends.base", "planner.backend"),
    ("fusion_planner.backends", "backends"),
    ("fusion_planner", "planner"),
)


def new_name(old: str) -> str | None:
    """The module an old ``fusion_planner`` module name is now, or None for a name that never was one."""
    for prefix, target in MOVED:
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


class _Alias(MetaPathFinder, Loader):
    """Imports an old module name as the module it moved to."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name == f"{__name__}.__main__" or not name.startswith(f"{__name__}."):
            return None  # python -m fusion_planner runs this package's own __main__
        return ModuleSpec(name, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(new_name(spec.name) or spec.name)

    def exec_module(self, module: ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Alias())

__all__ = ["new_name", "plan"]

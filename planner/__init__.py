"""Deprecated alias: the package is ``fusion_planner`` now (``import fusion_planner``).

``import planner``, ``planner.plan(...)`` and the old module paths (``planner.graph``,
``planner.torch_frontend``, ...) keep working, with a DeprecationWarning, until release
0.3, which removes them. Each old module name is the new module itself, not a copy.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

warnings.warn(
    "the 'planner' package is renamed 'fusion_planner'; 'planner' keeps working until release 0.3",
    DeprecationWarning,
    stacklevel=2,
)

#: old module name -> the module it is now
MOVED: dict[str, str] = {
    "planner.torch_frontend": "fusion_planner.torch.importer",
    "planner.torch_ops": "fusion_planner.torch.ops",
    "planner.torch_allowlist": "fusion_planner.core.torch_allowlist",
    "planner.ops": "fusion_planner.core.ops",
    "planner.opaque": "fusion_planner.core.opaque",
    "planner.graph": "fusion_planner.core.graph",
    "planner.plans": "fusion_planner.core.plans",
    "planner.cost": "fusion_planner.core.cost",
    "planner.tolerance": "fusion_planner.core.tolerance",
    "planner.inputs": "fusion_planner.core.inputs",
    "planner.regions": "fusion_planner.core.regions",
    "planner.planfile": "fusion_planner.core.planfile",
    "planner.examples": "fusion_planner.core.examples",
    "planner.machine": "fusion_planner.core.machine",
    "planner.report": "fusion_planner.core.report",
    "planner.rulegen": "fusion_planner.rules.rulegen",
    "planner.rulecheck": "fusion_planner.rules.check",
    "planner.egraph": "fusion_planner.egraph.program",
    "planner.extract": "fusion_planner.egraph.extract",
    "planner.candidates": "fusion_planner.egraph.candidates",
    "planner.mutate": "fusion_planner.search.mutate",
    "planner.searchlog": "fusion_planner.search.searchlog",
    "planner.searchplots": "fusion_planner.search.plots",
    "planner.search": "fusion_planner.search.engine",
    "planner.calibrate": "fusion_planner.backends.cpu.calibrate",
    "planner.model_plan": "fusion_planner.model.stack",
    "planner.plancache": "fusion_planner.model.plancache",
    "planner.pipeline": "fusion_planner.pipeline",
    "planner.api": "fusion_planner.api",
    "planner.cli": "fusion_planner.cli",
    "planner.errors": "fusion_planner.errors",
    "planner.commands": "fusion_planner.commands",
    "planner.commands.bench": "fusion_planner.commands.bench",
    "planner.commands.cache": "fusion_planner.commands.cache",
    "planner.commands.calibrate": "fusion_planner.commands.calibrate",
    "planner.commands.check_rules": "fusion_planner.commands.check_rules",
    "planner.commands.common": "fusion_planner.commands.common",
    "planner.commands.explain": "fusion_planner.commands.explain",
    "planner.commands.export": "fusion_planner.commands.export",
    "planner.commands.plan": "fusion_planner.commands.plan",
    "planner.commands.run": "fusion_planner.commands.run",
}


class _Alias(MetaPathFinder, Loader):
    """Imports an old module name as the module it moved to."""

    def __init__(self, moved: dict[str, str]) -> None:
        self.moved = moved

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return ModuleSpec(name, self) if name in self.moved else None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(self.moved[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Alias(MOVED))

from fusion_planner import plan  # noqa: E402

__all__ = ["plan"]

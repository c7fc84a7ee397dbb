"""Error classes that mean "bad input", gathered from every layer: the CLI reports them and exits 2."""

from __future__ import annotations

from fusion_planner.backends.base import BackendUnavailable
from fusion_planner.core.cost import DeviceSpecError
from fusion_planner.core.errors import UsageError
from fusion_planner.core.graph import GraphError
from fusion_planner.core.ops import OpError
from fusion_planner.core.planfile import PlanFileError
from fusion_planner.model.plancache import CacheClearRefused
from fusion_planner.rules.files import RuleFileError
from fusion_planner.torch.errors import TorchImportError

USER_ERRORS: tuple[type[BaseException], ...] = (
    GraphError,
    OpError,
    DeviceSpecError,
    RuleFileError,
    UsageError,
    TorchImportError,
    FileNotFoundError,
    PlanFileError,  # a tampered or mismatched plan.json
    CacheClearRefused,  # cache clear would touch files the cache did not write
    BackendUnavailable,  # the chosen backend needs a GPU, compiler or package this machine lacks
)

__all__ = ["USER_ERRORS", "TorchImportError", "UsageError"]

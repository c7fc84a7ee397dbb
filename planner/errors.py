"""Error classes that mean "bad input", gathered from every layer: the CLI reports them and exits 2."""

from __future__ import annotations

from planner.backend import BackendUnavailable
from planner.core.cost import DeviceSpecError
from planner.core.errors import UsageError
from planner.core.graph import GraphError
from planner.core.ops import OpError
from planner.core.planfile import PlanFileError
from planner.model.plancache import CacheClearRefused
from planner.rules.files import RuleFileError
from planner.torch.errors import TorchImportError

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

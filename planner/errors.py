"""Error classes that mean "bad input": the CLI reports them and exits 2."""

from __future__ import annotations

from backends.base import BackendUnavailable
from planner.cost import DeviceSpecError
from planner.egraph import RuleFileError
from planner.graph import GraphError
from planner.ops import OpError
from planner.plancache import CacheClearRefused
from planner.planfile import PlanFileError


class UsageError(ValueError):
    """A command-line value is out of range or inconsistent."""


class TorchImportError(ValueError):
    """A torch module could not be imported: untraceable code, a bad dtype or mismatched inputs."""


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

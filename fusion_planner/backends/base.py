"""The backend interface: compile a plan, run it, time it, report kernel facts.

Every backend (reference, model, cpu, cupy) implements :class:`Backend`.  The
search only talks to this interface.  Compilation happens in ``compile`` and
never inside ``time``; ``time`` takes warm-ups, repeats and an optional early
stop, and returns every sample so callers can take medians.
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusion_planner.core.cost import DeviceSpec
from fusion_planner.core.plans import Plan


class BackendError(RuntimeError):
    """A backend could not compile or run a plan; the message names the kernel."""


class BackendUnavailable(BackendError):
    """The backend needs something this machine lacks (a GPU, a compiler, a package)."""


@dataclass
class Timing:
    samples_us: list[float]
    warmup: int
    stopped_early: bool = False
    #: each kernel's fastest time (µs) over the timed runs, in plan order, where the backend times its kernels
    #: one by one inside them (the search bounds other plans with the same kernels by it); None otherwise
    kernel_min_us: list[float] | None = None

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)


def collect_samples(
    measure_us: Callable[[], float],
    *,
    warmup: int,
    repeats: int,
    stop_if: Callable[[float], bool] | None = None,
) -> Timing:
    """Warm-ups, then up to ``repeats`` samples of ``measure_us()``; ``stop_if(running median)``
    ends the sampling early.  Shared by every backend that really times."""
    for _ in range(warmup):
        measure_us()
    samples: list[float] = []
    for _ in range(repeats):
        samples.append(measure_us())
        if stop_if is not None and len(samples) < repeats and stop_if(statistics.median(samples)):
            return Timing(samples, warmup, stopped_early=True)
    return Timing(samples, warmup)


@dataclass
class CompiledPlan(ABC):
    plan: Plan
    #: per-kernel facts, in plan order: e.g. regs, spill_bytes, occupancy, bytes_moved
    kernel_facts: list[dict[str, Any]] = field(default_factory=list)
    compile_s: float = 0.0

    @abstractmethod
    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Execute once; returns the graph outputs as float32 (or float64) arrays."""

    def run_stored(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Execute once; each output as it is stored where the backend can hand it out so (a 16-bit output as a
        ``uint16`` array of its bits, which a torch face views as the dtype), else as :meth:`run` returns it."""
        return self.run(inputs)

    def time(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        warmup: int = 2,
        repeats: int = 7,
        stop_if: Callable[[float], bool] | None = None,
    ) -> Timing:
        """Time whole-plan executions; ``stop_if(running_median_us)`` ends it early."""
        raise BackendError(f"{type(self).__name__} does not time plans")


class Backend(ABC):
    name: str = "?"
    #: whether ``time`` measures real execution (False for the cost model)
    measures: bool = True

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec

    @property
    def identity(self) -> str:
        """What, besides the device, a plan chosen on this backend depends on (the plan cache keys on it)."""
        return self.name

    def prepare(self, plans: Sequence[Plan]) -> None:  # noqa: B027 - most backends have nothing to prepare
        """Get ready to compile ``plans`` soon (the CPU backend builds all their kernels in a few batched
        compiler runs); compiling a plan that was not prepared works all the same."""

    @abstractmethod
    def compile(self, plan: Plan) -> CompiledPlan:
        """Prepare a plan for execution (code generation, compilation, planning)."""

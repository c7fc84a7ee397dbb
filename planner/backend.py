"""The backend interface: compile a plan, run it, time it, report kernel facts; and what a backend plugin
registers.

Every backend (reference, model, cpu, cupy, measured) implements :class:`Backend`.  The
search only talks to this interface.  Compilation happens in ``compile`` and
never inside ``time``; ``time`` takes warm-ups, repeats and an optional early
stop, and returns every sample so callers can take medians.

A backend reaches the planner as a :class:`BackendPlugin` registered under the ``planner.backends``
entry-point group (or with :func:`planner.registry.register_backend` at run time): its factory, the options
it takes, and what it adds to the command line (subcommands, ``explain`` columns, calibrations).  The
planner never imports a backend by its module path.
"""

from __future__ import annotations

import argparse
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from planner.core.cost import DeviceSpec
from planner.core.graph import Graph
from planner.core.plans import Plan


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

    def run_handed(self, inputs: Mapping[str, np.ndarray], hand_out: Callable[[list[np.ndarray]], Any],
                   early: bool = False) -> Any:
        """Execute once and return ``hand_out(outputs)``, the outputs as :meth:`run_stored` gives them. ``early``:
        ``hand_out`` only wraps the arrays and reads no value, so a backend that has the outputs' arrays before its
        kernels run may call it then, while the caches still hold what the call just touched (the cpu backend)."""
        return hand_out(self.run_stored(inputs))

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
    #: whether ``time`` replays figures taken earlier (measured elsewhere): timing again gives the same figures,
    #: so the search neither duels nor re-measures on such a backend
    replays: bool = False

    @property
    def times_live(self) -> bool:
        """Does timing a plan again take new measurements here (so rounds and re-measurement mean something)?"""
        return self.measures and not self.replays

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec

    @property
    def identity(self) -> str:
        """What, besides the device, a plan chosen on this backend depends on (the plan cache keys on it)."""
        return self.name

    def fits(self, graph: Graph) -> None:  # noqa: B027 - most backends plan any graph
        """Refuse (``UsageError``) a graph this backend cannot answer for: the measured backend holds the timings
        of one exported graph only."""

    def prepare(self, plans: Sequence[Plan]) -> None:  # noqa: B027 - most backends have nothing to prepare
        """Get ready to compile ``plans`` soon (the CPU backend builds all their kernels in a few batched
        compiler runs); compiling a plan that was not prepared works all the same."""

    @abstractmethod
    def compile(self, plan: Plan) -> CompiledPlan:
        """Prepare a plan for execution (code generation, compilation, planning)."""


# ---------------------------------------------------------------- plugins


class Candidates(Protocol):
    """The costed candidates of one graph, as a plugin sees them (``planner.egraph.candidates.CandidateSet``)."""

    graph: Graph
    spec: DeviceSpec
    plans: list[Plan]

    @property
    def best(self) -> Plan: ...

    @property
    def unfused(self) -> Plan: ...


class Planning(Protocol):
    """What the command line lends a plugin's subcommand: the planner's shared arguments and its candidates,
    so that a backend adds commands without importing the planner's upper layers."""

    def add_graph_args(self, parser: argparse.ArgumentParser) -> None:
        """--example/--graph/--torch and the example sizes."""

    def add_planning_args(self, parser: argparse.ArgumentParser) -> None:
        """--device, --rules, the saturation and extraction limits, --json."""

    def graph(self, args: argparse.Namespace) -> Graph:
        """The graph the shared arguments name."""

    def device(self, name: str | None) -> DeviceSpec:
        """A device spec by name or file (None: the default)."""

    def candidates(self, args: argparse.Namespace, graph: Graph) -> Candidates:
        """The costed candidates of ``graph`` under the planning arguments."""

    def candidates_of(self, graph: Graph, spec: DeviceSpec, *, cap: int) -> Candidates:
        """The costed candidates of ``graph`` with the shipped rules and default limits, up to ``cap`` plans."""

    def emit_json(self, obj: Any) -> None:
        """Print one JSON object on stdout."""


@dataclass(frozen=True)
class PluginCommand:
    """A subcommand a backend adds: ``register(subparsers, planning)`` adds its parser, whose handler takes the
    parsed arguments and returns an exit code."""

    name: str
    register: Callable[[Any, Planning], None]


@dataclass(frozen=True)
class ExplainColumn:
    """A column a backend adds to ``fusion-planner explain`` behind a flag: ``annotate(candidates)`` attaches
    its facts to the plans (it may re-order them), ``cell(plan)`` renders one."""

    flag: str
    help: str
    header: str
    annotate: Callable[[Candidates], None]
    cell: Callable[[Plan], str]


@dataclass(frozen=True)
class Calibration:
    """A way ``fusion-planner calibrate`` makes a device spec with a backend: ``add_args(parser)`` adds its
    options; ``run(args)`` returns the spec and one line saying what was measured. ``selected_by``: the
    destination of an option whose presence chooses this calibration (else ``--backend`` chooses)."""

    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], tuple[DeviceSpec, str]]
    selected_by: str | None = None


@dataclass(frozen=True)
class BackendPlugin:
    """What a backend registers: ``create(spec, **options)`` builds it; ``options`` names the keyword options it
    takes (``threads``, ``source``); ``auto_rank`` orders the backends ``torch.compile`` may pick on its own
    (lowest first, among those whose ``usable()`` is true; None: never picked unasked)."""

    name: str
    create: Callable[..., Backend]
    summary: str
    options: frozenset[str] = frozenset()
    auto_rank: int | None = None
    usable: Callable[[], bool] = field(default=lambda: True)
    commands: tuple[PluginCommand, ...] = ()
    explain_columns: tuple[ExplainColumn, ...] = ()
    calibration: Calibration | None = None
    #: the device spec a search on this backend is costed with when the caller names none (the cpu backend: this
    #: machine's calibrated spec); None: the planner's default (``planner.core.cost.DEFAULT_DEVICE``)
    default_device: Callable[[], DeviceSpec] | None = None
    #: what one worker of a cluster search owns on this backend (planner.cluster): "cpu", its ``threads`` cores
    #: pinned, or "gpu", one GPU
    worker_device: str = "cpu"

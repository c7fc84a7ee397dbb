"""The model backend: plans without hardware.

``run`` is the reference executor (device mode), so candidates are still
verified; ``time`` reports the cost model's estimate ``plan.est_us`` as a
single sample, so a search over this backend ranks plans by the model alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from backends.reference import ledger_facts
from planner.backend import Backend, BackendPlugin, CompiledPlan, Timing
from planner.core.plans import Plan
from planner.core.reference import execute_plan


@dataclass
class ReplayedPlan(CompiledPlan):
    """Runs on the reference executor; its timing is given, not measured here
    (the cost model's estimate, or samples measured on another machine)."""

    samples_us: list[float] = field(default_factory=list)

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return execute_plan(self.plan, inputs, mode="device")

    def time(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        warmup: int = 2,
        repeats: int = 7,
        stop_if: Callable[[float], bool] | None = None,
    ) -> Timing:
        """The given samples.  Nothing runs, so warm-ups and repeats do not apply."""
        return Timing(list(self.samples_us), warmup=0, stopped_early=False)


class ModelBackend(Backend):
    name = "model"
    measures = False

    def compile(self, plan: Plan) -> ReplayedPlan:
        return ReplayedPlan(plan, ledger_facts(plan), samples_us=[plan.est_us])


PLUGIN = BackendPlugin("model", ModelBackend, "the cost model: its estimates as timings, candidates verified on the "
                       "reference executor")

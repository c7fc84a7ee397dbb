"""The reference backend: runs plans through the numpy executor; correctness only.

It cannot time anything (``time`` raises :class:`BackendError`): its numbers
would measure numpy, not the plan.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from planner.backend import Backend, BackendPlugin, CompiledPlan
from planner.core.plans import Plan
from planner.core.reference import execute_plan


def ledger_facts(plan: Plan) -> list[dict[str, object]]:
    """Per-kernel facts a non-executing backend knows: the cost model's ledgers."""
    return [{"bytes_moved": k.cost.bytes, "est_us": k.cost.est_us} for k in plan.kernels]


class ReferenceCompiledPlan(CompiledPlan):
    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return execute_plan(self.plan, inputs, mode="device")


class ReferenceBackend(Backend):
    name = "reference"
    measures = False

    def compile(self, plan: Plan) -> ReferenceCompiledPlan:
        return ReferenceCompiledPlan(plan, ledger_facts(plan))


PLUGIN = BackendPlugin("reference", ReferenceBackend, "the numpy reference executor: verifies candidates, times none",
                       auto_rank=2)

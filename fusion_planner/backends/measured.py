"""Results measured elsewhere, replayed into the search (``plan --measured``).

The remote runner (``python -m fusion_planner.backends.cupy time``) verified every candidate
against a numpy reference computed on the GPU machine and timed it there.  This
backend hands those results to the search as if they were measured here: a
candidate the runner rejected is rejected with the runner's reason, a candidate
the file does not hold is rejected as "not measured remotely", and a timed one
reports the runner's samples and per-kernel facts.  Its outputs are the local
reference's: the numerics were checked where the kernels ran.
"""

from __future__ import annotations

import json
from pathlib import Path

from fusion_planner.backends.base import Backend, BackendError, CompiledPlan
from fusion_planner.backends.cupy.runner import load_measured
from fusion_planner.backends.model import ReplayedPlan
from fusion_planner.core.cost import DeviceSpec
from fusion_planner.core.kinds import is_rejected
from fusion_planner.core.plans import Plan


class MeasuredBackend(Backend):
    measures = True

    def __init__(self, spec: DeviceSpec, path: str | Path) -> None:

        super().__init__(spec)
        self.results = load_measured(path)
        #: the graph the remote runner timed (plan keys do not encode shapes, so callers must compare it)
        head = json.loads(Path(path).read_text())
        self.graph_name = str(head.get("graph") or "")
        self.graph_sha256 = str(head.get("graph_sha256") or "")
        executors = {m.executor for m in self.results.values()}
        self.name = f"measured({', '.join(sorted(executors)) or 'empty'})"

    def compile(self, plan: Plan) -> CompiledPlan:
        m = self.results.get(plan.key)
        if m is None:
            raise BackendError("not measured remotely (not in the measured file)")
        if is_rejected(m.verdict):
            raise BackendError(f"remote {m.verdict}")
        if m.meas_us is None:
            raise BackendError(f"remote verdict {m.verdict!r}: no timing")
        return ReplayedPlan(plan, [dict(k) for k in m.kernels], samples_us=list(m.samples_us) or [m.meas_us])

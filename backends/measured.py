"""Results measured elsewhere, replayed into the search (``plan --measured``).

The remote runner (``python -m backends.cupy time``) verified every candidate
against a numpy reference computed on the GPU machine and timed it there.  This
backend hands those results to the search as if they were measured here: a
candidate the runner rejected is rejected with the runner's reason, a candidate
the file does not hold is rejected as "not measured remotely", and a timed one
reports the runner's samples and per-kernel facts (its CUDA-graph replay time instead where every timed
candidate has one: ``backends.cupy.runner.ranks_by_graph``).  Its outputs are the local
reference's: the numerics were checked where the kernels ran.
"""

from __future__ import annotations

from pathlib import Path

from backends.cupy.runner import MeasuredError, load_measured, ranks_by_graph
from backends.model import ReplayedPlan
from planner.backend import Backend, BackendError, BackendPlugin, CompiledPlan
from planner.core.cost import DeviceSpec
from planner.core.errors import UsageError
from planner.core.files import read_json
from planner.core.graph import Graph
from planner.core.kinds import is_rejected
from planner.core.plans import Plan


class MeasuredBackend(Backend):
    measures = True
    replays = True

    def __init__(self, spec: DeviceSpec, path: str | Path) -> None:
        super().__init__(spec)
        self.path = str(path)
        self.results = load_measured(path)
        #: the graph the remote runner timed (plan keys do not encode shapes, so callers must compare it)
        head = read_json(path, MeasuredError, "measured-results file")
        self.graph_name = str(head.get("graph") or "")
        self.graph_sha256 = str(head.get("graph_sha256") or "")
        self.by_graph = ranks_by_graph(self.results)
        executors = {m.executor for m in self.results.values()}
        timing = "CUDA-graph replays" if self.by_graph else "events"
        self.name = f"measured({', '.join(sorted(executors)) or 'empty'}; {timing})"

    def fits(self, graph: Graph) -> None:
        """Plan keys name kernels, not shapes: another graph's timings would merge silently."""
        if self.graph_name != graph.name:
            raise UsageError(f"--measured {self.path}: timed for graph {self.graph_name!r}, not {graph.name!r}; "
                             "plan the graph that export-candidates wrote")
        if self.graph_sha256 and self.graph_sha256 != graph.fingerprint():
            raise UsageError(f"--measured {self.path}: timed for another graph of the same name {graph.name!r} "
                             "(its structure or shapes differ); plan the graph that export-candidates wrote")

    def compile(self, plan: Plan) -> CompiledPlan:
        m = self.results.get(plan.key)
        if m is None:
            raise BackendError("not measured remotely (not in the measured file)")
        if is_rejected(m.verdict):
            raise BackendError(f"remote {m.verdict}")
        if m.meas_us is None:
            raise BackendError(f"remote verdict {m.verdict!r}: no timing")
        if self.by_graph and m.graph_us is not None:
            return ReplayedPlan(plan, [dict(k) for k in m.kernels], samples_us=[m.graph_us])
        return ReplayedPlan(plan, [dict(k) for k in m.kernels], samples_us=list(m.samples_us) or [m.meas_us])


def open_measured(spec: DeviceSpec, source: str | Path | None = None) -> MeasuredBackend:
    """The measured backend of one results file (``plan --measured FILE``)."""
    if source is None:
        raise UsageError("the measured backend replays a results file: give it with --measured FILE")
    if not Path(source).is_file():
        raise UsageError(f"--measured {source}: no such file")
    try:
        return MeasuredBackend(spec, source)
    except MeasuredError as exc:
        raise UsageError(str(exc)) from None


PLUGIN = BackendPlugin("measured", open_measured, "results timed on another machine (python -m backends.cupy time), "
                       "replayed into the search", options=frozenset({"source"}))

"""The Python API: ``planner.plan(model, example_inputs) -> PlanResult``.

``plan`` imports a torch module (or takes an IR :class:`~planner.core.graph.Graph`),
builds the costed candidates, lets the measured search choose a plan on the
requested backend, checks the chosen plan against eager torch on the example
inputs, and returns a :class:`PlanResult` that executes it.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.backend import Backend, CompiledPlan
from planner.cluster.pool import ExecutorOptions
from planner.core.cost import DeviceSpec
from planner.core.graph import Graph, load_graph
from planner.core.kinds import Verdict
from planner.core.planfile import save_plan
from planner.core.plans import Plan
from planner.core.reference import execute_plan, random_inputs
from planner.core.report import kernels_text, ledger_table, region_title
from planner.core.tolerance import allclose_report, least_precise, tolerance, working_dtype
from planner.egraph.candidates import DEFAULT_CAP, DEFAULT_K, CandidateSet
from planner.egraph.program import Limits
from planner.model.plancache import PlanCache
from planner.pipeline import Planned, PlanOptions, plan_graph
from planner.registry import device_for, get_backend
from planner.rules.load import load_rules
from planner.search.results import SearchOptions
from planner.search.searchlog import SearchLog

if TYPE_CHECKING:
    from planner.torch.importer import ImportedModule

log = logging.getLogger(__name__)


class PlanMismatchError(RuntimeError):
    """The chosen plan's outputs differ from eager torch beyond the dtype's tolerance."""


#: runs a plan on its graph inputs and returns ``hand_out(outputs)``; ``early``: ``hand_out`` reads no value
#: (``CompiledPlan.run_handed``)
Runner = Callable[[Mapping[str, np.ndarray], Callable[[list[np.ndarray]], Any], bool], Any]


@dataclass
class PlanResult:
    """The chosen plan of a model and a callable that executes it."""

    graph: Graph
    plan: Plan
    candidates: CandidateSet | None  # None when regions were planned one by one (``model_plan``)
    backend: str
    spec: DeviceSpec
    log: list[str]
    imported: ImportedModule | None = None
    module: Any = None
    search_result: Any = None  # planner.search.engine.SearchResult when the search ran
    _runner: Runner | None = field(default=None, repr=False)
    model_plan: Any = None  # planner.model.stack.ModelPlan when repeated regions were planned once each
    planned: Planned | None = None  # what the pipeline decided (cache key, from the cache, composite check)
    _bound: Any = field(default=None, repr=False)  # torch.importer.BoundInputs: parameters converted once
    #: eager torch's time over the plan's, end to end, re-measured interleaved (a module on a measuring backend)
    vs_eager: float | None = None
    #: the plan as the backend built it (kernel facts; ``execute()`` on the cpu backend), None on reference
    compiled: CompiledPlan | None = field(default=None, repr=False)
    #: a planned module's guard (``planner.torch.guards.CallGuard``): which plan runs a call, or eager torch
    guard: Any = field(default=None, repr=False)
    #: compare every byte of the bound parameters each call, not a sample (``BoundInputs``)
    exact_weights: bool = False
    #: one call at a time: a plan runs in its own buffers, and the guard keeps state between calls
    _turn: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        """Execute the chosen plan; torch tensors in and out for a module, numpy arrays for a Graph. A planned
        module's guard first checks that the module and the inputs' layout are what a plan was made for. Inputs
        named as the module's forward names them are taken in its order. Calls from several threads take turns."""
        if named:
            inputs = self._positional(inputs, named)
        with self._turn:
            if self.guard is not None:
                return self.guard(inputs)
            return self.call_plan(inputs)

    def _positional(self, inputs: tuple[Any, ...], named: dict[str, Any]) -> tuple[Any, ...]:
        """``inputs`` and ``named`` as the module's forward takes them, by position (the parameters after the last
        one given left out, to their defaults, as a call by position leaves them)."""
        forward = getattr(self.module, "forward", None)
        if forward is None:
            raise TypeError(f"a plan of a graph takes its inputs as one dict, not by name ({', '.join(named)})")
        try:
            bound = inspect.signature(forward).bind(*inputs, **named)
        except TypeError as exc:
            raise TypeError(f"{type(self.module).__name__}.forward: {exc}") from None
        params = list(bound.signature.parameters.values())
        given = [p for p in params if p.name in bound.arguments]
        unplaced = [p.name for p in given if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if unplaced:
            raise TypeError(f"{type(self.module).__name__}.forward: a plan takes the inputs its forward takes by "
                            f"position; {', '.join(unplaced)} cannot be")
        last = max(params.index(p) for p in given)
        bound.apply_defaults()
        return tuple(bound.arguments[p.name] for p in params[:last + 1])

    def call_plan(self, inputs: Sequence[Any], arrays: Sequence[np.ndarray] | None = None) -> Any:
        """Execute this plan, unguarded. ``arrays``: the inputs (tensors of the layout this plan was made for,
        fp32 or 16-bit on the host, needing no grad: the guard checked) as numpy arrays over their memory
        (``guards.call_layout``). Calls from several threads take turns."""
        with self._turn:
            return self._call_plan(inputs, arrays)

    def _call_plan(self, inputs: Sequence[Any], arrays: Sequence[np.ndarray] | None) -> Any:
        assert self._runner is not None
        if self.imported is None:
            (feed,) = inputs
            return self._runner(feed, list, False)
        if self._bound is None:
            from planner.torch.importer import BoundInputs

            self._bound = BoundInputs(self.imported, self.module, exact=self.exact_weights)
        flat = list(inputs) if arrays is not None else self.imported.check_args(inputs)
        imported = self.imported
        return self._runner(self._bound.feed_checked(flat, arrays), lambda outs: imported.wrap_outputs(outs, flat),
                            self._views_only)

    @functools.cached_property
    def _views_only(self) -> bool:
        """Does handing the outputs out as torch tensors only view their arrays (no conversion reads a value)?"""
        assert self.imported is not None
        return self.imported.wraps_views([self.plan.tensors[o].dtype for o in self.plan.outputs])

    @property
    def bound(self) -> Any:
        """The module's bound inputs (``torch.importer.BoundInputs``) once the plan has been called."""
        return self._bound

    def rebind(self) -> None:
        """Convert the module's parameters again on the next call, in every plan kept for the module (a write
        that bypasses torch's version counter and misses the sampled bytes is seen after this)."""
        plans = self.guard.plans.values() if self.guard is not None else [self]
        for p in plans:
            if p is not None and p._bound is not None:
                p._bound.rebind()

    def check(self, expected: Any, *inputs: Any) -> list[tuple[float, float]]:
        """Run the plan on ``inputs`` and compare with ``expected`` (eager torch outputs).

        Returns (max abs, max rel) per output; raises :class:`PlanMismatchError`
        when an output breaks its dtype's tolerance.
        """
        import torch
        from torch.utils import _pytree as pytree

        from planner.torch.importer import TORCH_DTYPES

        got = pytree.tree_leaves(self(*inputs))
        want = [t for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
        errors = []
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            dtype = self._output_dtype(i, TORCH_DTYPES[w.dtype])
            ok, max_abs, max_rel = allclose_report(g.float().numpy(), w.detach().float().numpy(), dtype)
            log.info("output %d vs eager torch (%s): max abs %.3g, max rel %.3g", i, dtype, max_abs, max_rel)
            if not ok:
                raise PlanMismatchError(
                    f"output {i} of the chosen plan differs from eager torch beyond the {dtype} tolerance "
                    f"{tolerance(dtype)}: max abs {max_abs:.3g}, max rel {max_rel:.3g}; "
                    f"{self._mismatch_diagnosis(i, inputs, g, w, dtype)}; the plan: {self.plan.notation()}"
                )
            errors.append((max_abs, max_rel))
        return errors

    def _mismatch_diagnosis(self, i: int, inputs: Sequence[Any], got: Any, want: Any, dtype: str) -> str:
        """Where a wrong output ``i`` (``got``, against eager's ``want``) comes from: a second run of the plan on
        the same inputs (do its kernels give what they gave?), and the numpy reference of the plan's kernels
        there (is the plan, or the import, wrong, or the backend's code for it?)."""
        from torch.utils import _pytree as pytree

        again = pytree.tree_leaves(self.call_plan(inputs))[i]
        rerun = float(np.max(np.abs(again.float().numpy() - got.float().numpy()), initial=0.0))
        said = [f"a second run differs from the first by max abs {rerun:.3g}"
                + (" (its kernels are not deterministic)" if rerun else "")]
        if self.imported is not None and self._bound is not None:
            flat = self.imported.check_args(inputs)
            ref = pytree.tree_leaves(self.imported.wrap_outputs(
                execute_plan(self.plan, self._bound.feed_checked(flat, None), mode="device"), flat))[i]
            ok, ref_abs, _ = allclose_report(ref.float().numpy(), want.detach().float().numpy(), dtype)
            said.append(f"the numpy reference of its kernels on the same inputs {'agrees with' if ok else 'differs from'}"
                        f" eager torch (max abs {ref_abs:.3g}: " + ("the backend computed them wrong)" if ok else
                                                                    "the plan or the import is wrong)"))
        return "; ".join(said)

    def _output_dtype(self, i: int, dtype: str) -> str:
        """The dtype whose tolerance judges output ``i``: the least precise one its value was computed through."""
        if self.imported is None or len(self.imported.outputs) <= i:
            return dtype
        return least_precise([dtype, working_dtype(self.plan, self.plan.outputs[self.imported.outputs[i].index])])

    def table(self, all: bool = False) -> str:  # noqa: A002  (the CLI's --all)
        """Ledger table, the chosen plan starred: the tried candidates with measured times after a search,
        else the costed candidates; at most 40 rows of 120 characters unless ``all``."""
        extra: list[tuple[str, Callable[[Plan], str]]] = []
        if self.search_result is not None:
            meas = {e.plan.key: e for e in self.search_result.entries}

            def measured(p: Plan) -> str:
                e = meas.get(p.key)
                return "-" if e is None or e.meas_us is None else f"{e.meas_us:,.2f}"

            def verdict(p: Plan) -> str:
                e = meas.get(p.key)
                return "-" if e is None else e.verdict_text

            extra = [("meas_us", measured), ("verdict", verdict)]
            tried = [e.plan for e in self.search_result.entries if e.verdict != Verdict.NOT_TIMED]
            return ledger_table(sorted(tried, key=Plan.sort_key), self.plan.key, extra, full=all) + self._speedups()
        if self.model_plan is None:  # answered from the plan cache
            return ledger_table([self.plan], self.plan.key) + "\n(plan from the plan cache, not re-searched)"
        if self.candidates is None:  # region-wise: the composite plan and each region's choice
            lines = [ledger_table([self.plan], self.plan.key)]
            for u in self.model_plan.unique.values():
                lines.append(f"region {region_title(u.region)} x{u.instances}: {kernels_text(u.plan, None)}  "
                             f"est {u.plan.est_us:,.2f} us")
            return "\n".join(lines)
        return ledger_table(self.candidates.plans, self.plan.key, full=all)

    def _speedups(self) -> str:
        """The table's footer: the chosen plan against the unfused one and eager torch, both re-measured
        interleaved (the search's own figures came minutes apart)."""
        parts = []
        unfused = getattr(self.search_result, "speedup_vs_unfused", None)
        if unfused is not None:
            parts.append(f"best vs unfused {unfused:.2f}x")
        if self.vs_eager is not None:
            parts.append(f"vs eager torch {self.vs_eager:.2f}x")
        return f"\n{', '.join(parts)} (interleaved re-measurements)" if parts else ""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "graph": self.graph.name,
            "device": self.spec.name,
            "backend": self.backend,
            "best": self.plan.to_json(),
            "log": list(self.log),
        }
        if self.search_result is not None:
            d["search"] = self.search_result.to_json()
        elif self.candidates is not None:
            d["candidates"] = self.candidates.to_json()
        if self.model_plan is not None:
            d["regions"] = self.model_plan.summary()
        if self.vs_eager is not None:
            d["vs_eager_torch"] = round(self.vs_eager, 4)
        if self.imported is not None:
            d["opaque_ops"] = list(self.imported.opaque_ops)
            d["tracer"] = self.imported.tracer
        return d

    def save(self, directory: str | Path) -> Path:
        """Write graph.json, plan.json (re-executable with ``fusion-planner run``) and results.json.

        Opaque kernels name their registered implementation; nothing is pickled.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "graph.json").write_text(self.graph.dumps() + "\n")
        meta: dict[str, Any] = {"backend": self.backend}
        if self.imported is not None:
            meta.update(tracer=self.imported.tracer, opaque_ops=list(self.imported.opaque_ops))

        save_plan(out / "plan.json", self.plan, self.graph, self.spec, meta)
        (out / "results.json").write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        return out


def _runner(name: str, plan: Plan, backend: Backend, stored: bool) -> tuple[Runner, CompiledPlan | None]:
    """How the plan runs for the caller; ``stored``: outputs as the backend stores them (a torch module's call,
    whose 16-bit outputs are handed out as their bits), else float32 arrays (a graph's numpy outputs)."""
    if name == "reference":  # the numpy executor in device mode, without timing machinery
        return (lambda feed, hand_out, early: hand_out(execute_plan(plan, feed, mode="device"))), None
    compiled = backend.compile(plan)
    if stored:
        return compiled.run_handed, compiled
    return (lambda feed, hand_out, early: hand_out(compiled.run(feed))), compiled


def _omp_quiet() -> bool:
    env = os.environ
    return env.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" or env.get("OMP_NUM_THREADS") == "1"


def plan(
    module_or_graph: Any,
    example_inputs: Any = None,
    backend: str = "cpu",
    device: str | DeviceSpec | None = None,
    *,
    rules: Sequence[str | Path] = (),
    limits: Limits | None = None,
    cap: int = DEFAULT_CAP,
    k: int = DEFAULT_K,
    verify: bool = True,
    dedup: bool = True,
    cache: bool = True,
    allow_torch_ops: Sequence[str] = (),
    threads: int | None = None,
    on_change: str | None = "replan",
    exact_weights: bool = False,
    by_region: bool = False,
    executor: str = "serial",
    workers: int | None = None,
    ray_address: str | None = None,
    keep_workers: float | None = None,
    **search_opts: Any,
) -> PlanResult:
    """Plan a torch module (or an IR graph) and return the executable :class:`PlanResult`.

    ``example_inputs`` are the module's call inputs (a tensor or a tuple); for a
    :class:`Graph` they are a dict of numpy arrays (random when omitted).
    ``backend`` is where candidates are measured and the chosen plan runs
    (reference, model, cpu, cupy); ``device`` is the DeviceSpec of the cost
    model.  Remaining keywords go to :class:`planner.search.engine.SearchOptions`.
    With ``verify`` the chosen plan is checked against eager torch once.
    With ``dedup``, a graph whose regions repeat (a layer stack) is planned region
    by region, each distinct region searched once; chosen region plans are kept
    in the plan cache unless ``cache`` is false (docs/scaling.md).
    A ``str`` or ``Path`` is a graph JSON file, loaded as untrusted data: its torch-backed
    Opaque nodes may name only allowlisted torch callables and ``allow_torch_ops``
    (exact canonical names the caller trusts; docs/security.md).
    ``threads``: the cpu backend's worker threads (default ``$FUSION_PLANNER_THREADS``, else every
    available core); the search times on that many and the plan runs on that many.
    A planned ``nn.Module`` is guarded (``planner.torch.guards``): each call checks that the module and its
    inputs' layouts are what its plan was made for; when they are not, ``on_change`` decides: ``replan`` (plan
    again, through the plan cache, up to 8 plans), ``eager`` (run the module eagerly) or ``error`` (raise
    ``GuardError``); None: no guard (the caller vouches that nothing changes). Parameters are bound again when
    they are replaced or written (``exact_weights``: compare every byte each call, not a sample; docs/torch.md).
    ``by_region`` plans region by region even where no region repeats (docs/scaling.md). ``executor="ray"`` fans
    the distinct regions out over a Ray cluster's workers, each on its own device: a local
    cluster of ``workers`` (default: the cores over ``threads``, which defaults to 1 there), or the cluster at
    ``ray_address`` (docs/scaling.md, "Many machines"); ``keep_workers``: seconds the workers are kept for
    the next search on a cluster this call did not start (default 600 with ``ray_address``, else 0).
    """
    fanout = ExecutorOptions(executor, workers, ray_address, keep_s=keep_workers)
    fanout.validate()
    threads = fanout.threads(backend, threads)
    if allow_torch_ops:
        from planner.torch.ops import allow_torch_ops as allow  # torch is optional

        allow(allow_torch_ops)
    if isinstance(module_or_graph, (str, Path)):
        module_or_graph = load_graph(module_or_graph)
    spec = device_for(device, backend)
    imported, module, args, bound = None, None, None, None
    if isinstance(module_or_graph, Graph):
        graph = module_or_graph
        if example_inputs is None:
            example_inputs = random_inputs(graph, seed=int(search_opts.get("seed", 0)))
        feed = dict(example_inputs)
    else:
        from planner.torch.importer import BoundInputs, ImportedModule, import_module

        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        if isinstance(module_or_graph, ImportedModule):
            imported = module_or_graph
        else:
            module = module_or_graph
            imported = import_module(module, args)
        graph = imported.graph
        bound = BoundInputs(imported, module, exact=exact_weights)  # the search's feed; the plan's calls reuse it
        feed = bound.feed(args)
        import torch

        if isinstance(module, torch.export.ExportedProgram):
            module = module.module()  # what eager torch runs, for the check and the re-measurement
    # only Opaque nodes an output depends on run (a model's cache slices no caller reads are left out)
    if backend == "cpu" and any(n.op == "Opaque" for n in graph.live().ops) and not _omp_quiet():
        log.warning(
            "torch-backed Opaque kernels share the cores with the timed cpu kernels: torch's spinning OpenMP "
            "workers can stall measurements by tens of ms; set OMP_WAIT_POLICY=PASSIVE (or OMP_NUM_THREADS=1) "
            "before torch is imported for stable timings"
        )
    options = PlanOptions(backend, spec, tuple(load_rules(rules)), limits, cap, k, SearchOptions(**search_opts), dedup,
                          executor=fanout, by_region=by_region, backend_options={"threads": threads})
    options.search.validate()
    be = get_backend(backend, spec, threads=threads)
    planned = plan_graph(graph, options, be, cache=PlanCache() if cache else None, inputs=feed)
    best = planned.plan
    runner, compiled = _runner(backend, best, be, stored=imported is not None)
    result = PlanResult(graph, best, planned.candidates, backend, spec, planned.log_lines, imported, module,
                        planned.search, runner, model_plan=planned.model, planned=planned, _bound=bound,
                        compiled=compiled, exact_weights=exact_weights)
    log.info("%s: chose %s (%s) on %s", graph.name, best.notation(), best.composition(), backend)
    if verify and module is not None and args is not None:
        import torch

        with torch.no_grad():
            expected = module(*args)
        result.check(expected, *args)
        if be.measures and planned.search is not None:  # a search ran (not a plan-cache answer): re-measure
            result.vs_eager = versus_eager(result, module, args)
            line = f"vs eager torch: {result.vs_eager:.2f}x (interleaved re-measurement of both end-to-end calls)"
            result.log.append(line)
            SearchLog().emit(line)  # the search trail's last line under SEARCH_LOG=1
    if on_change is not None and imported is not None and isinstance(module, _nn_module()) and args is not None:
        result.guard = module_guard(result, module, args, on_change, functools.partial(
            plan, module, backend=backend, device=spec, rules=rules, limits=limits, cap=cap, k=k, verify=verify,
            dedup=dedup, cache=cache, threads=threads, on_change=None, exact_weights=exact_weights, by_region=by_region,
            executor=executor, workers=workers, ray_address=ray_address, keep_workers=keep_workers,
            **search_opts))
    return result


def _nn_module() -> type:
    import torch  # a module was planned: torch is imported

    return torch.nn.Module


def module_guard(result: PlanResult, module: Any, args: Sequence[Any], on_change: str,
                 replan: Callable[..., PlanResult]) -> Any:
    """The guard of a planned module: what its plan assumed, and how to plan it again for other inputs."""
    from planner.torch.guards import CallGuard, ModuleState, input_signature

    assert result.imported is not None
    keys = tuple(dict.fromkeys(str(k) for b in result.imported.bindings if b.source in ("state", "packed")
                               for k in (b.key if b.source == "packed" else (b.key,))))  # type: ignore[union-attr]
    folded = result.imported.folded_from
    guard = CallGuard(module, lambda new_args: replan(new_args), on_change, ModuleState.record(module, keys, folded),
                      keys, folded)
    guard.plans[input_signature(args)] = result
    return guard


def versus_eager(result: PlanResult, module: Any, args: Sequence[Any], rounds: int = 3) -> float:
    """Eager torch's time over the plan's, end to end (torch tensors in and out), the two calls alternating
    round by round so that both see the same machine load; medians over all rounds."""
    import torch

    def eager() -> Any:
        with torch.no_grad():
            return module(*args)

    def planned() -> Any:
        return result(*args)

    samples: dict[str, list[float]] = {"eager": [], "plan": []}
    for _ in range(rounds):
        for name, fn in (("eager", eager), ("plan", planned)):
            for _ in range(3):
                t0 = time.perf_counter_ns()
                fn()
                samples[name].append(time.perf_counter_ns() - t0)
    return float(np.median(samples["eager"]) / np.median(samples["plan"]))

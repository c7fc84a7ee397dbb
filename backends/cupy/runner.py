"""Verify and time a candidates bundle: ``python -m backends.cupy time cands.json -o measured.json``.

Runs where only numpy (and cupy / nvmath-python for ``--executor cupy``) exist:
nothing here imports egglog.  Each candidate is first checked against the
bundle's reference (the unfused plan in fp64 numpy); only a candidate that
matches is timed.  ``load_measured`` reads the result back for the planner's
``plan --measured``.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from backends.cupy.bundle import Bundle, Candidate
from planner.core.files import read_json
from planner.core.kinds import Verdict, rejected
from planner.core.machine import cpu_model
from planner.core.reference import execute_plan
from planner.core.schema import check_document
from planner.core.tolerance import check_outputs

log = logging.getLogger(__name__)

MEASURED_SCHEMA = "fusion-planner/measured/1"


class MeasuredError(ValueError):
    """A measured-results file is malformed; the message names the field."""


class Prepared(Protocol):
    """A candidate ready to run: compiled kernels, planned GEMMs, allocated buffers."""

    kernel_facts: list[dict[str, Any]]

    def run(self) -> list[np.ndarray]: ...

    def time(self, warmup: int, repeats: int) -> list[float]: ...


class Executor(Protocol):
    name: str

    def machine(self) -> dict[str, Any]: ...

    def prepare(self, cand: Candidate, inputs: Mapping[str, np.ndarray]) -> Prepared: ...


# ---------------------------------------------------------------- numpy executor


@dataclass
class NumpyPrepared:
    cand: Candidate
    inputs: Mapping[str, np.ndarray]
    kernel_facts: list[dict[str, Any]] = field(default_factory=list)

    def run(self) -> list[np.ndarray]:
        return execute_plan(self.cand.plan, self.inputs, mode="device")

    def time(self, warmup: int, repeats: int) -> list[float]:
        for _ in range(warmup):
            self.run()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.run()
            samples.append((time.perf_counter() - t0) * 1e6)
        return samples


class NumpyExecutor:
    """Executes each kernel body with numpy on the CPU (fp32 registers, rounded stores)."""

    name = "numpy"

    def machine(self) -> dict[str, Any]:
        return {"executor": "numpy", "machine": platform.machine(), "processor": cpu_model()}

    def prepare(self, cand: Candidate, inputs: Mapping[str, np.ndarray]) -> Prepared:
        facts = [{"kind": bk.kernel.kind, **bk.kernel.facts} for bk in cand.kernels]
        return NumpyPrepared(cand, inputs, facts)


def make_executor(name: str) -> Executor:
    if name == "numpy":
        return NumpyExecutor()
    if name == "cupy":
        from backends.cupy.gpu import CupyExecutor

        return CupyExecutor()
    raise ValueError(f"unknown executor {name!r}; choose numpy or cupy")


# ---------------------------------------------------------------- timing a bundle


def reference_outputs(bundle: Bundle, inputs: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The unfused plan's outputs as a device computes them, and in fp64 (the oracle): what
    :func:`planner.core.tolerance.check_outputs` compares a candidate with, here as in the search."""
    return execute_plan(bundle.reference, inputs, mode="device"), execute_plan(bundle.reference, inputs, mode="oracle")


def _failed(entry: dict[str, Any], cand: Candidate, step: str, exc: Exception) -> dict[str, Any]:
    """Reject one candidate for an exception in ``step`` ("" for preparing or running it)."""
    log.warning("candidate %s failed%s: %s", cand.plan.notation(), f" ({step})" if step else "", exc)
    entry["meas_us"], entry["samples_us"] = None, []
    why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    entry["verdict"] = rejected(f"{step} failed: {why}" if step else why)
    return entry


def _verify_and_time(entry: dict[str, Any], cand: Candidate, prepared: Any,
                     expected: tuple[list[np.ndarray], list[np.ndarray]], warmup: int, repeats: int) -> None:
    try:
        entry["kernels"] = prepared.kernel_facts
        outs = prepared.run()
    except Exception as exc:
        _failed(entry, cand, "", exc)
        return
    device, oracle = expected
    reason, max_abs, max_rel = check_outputs(cand.plan, outs, device, oracle=oracle)
    entry["max_abs"], entry["max_rel"] = max_abs, max_rel
    if reason is not None:
        entry["verdict"] = rejected(f"mismatch ({reason})")
        return
    try:  # timing fails too sometimes (a capture invalidated by the library): this candidate only
        samples = prepared.time(warmup, repeats)
        entry["samples_us"] = [round(s, 3) for s in samples]
        entry["meas_us"] = round(statistics.median(samples), 3)
        entry["verdict"] = Verdict.TIMED
        graph_time = getattr(prepared, "time_graph", None)
        if graph_time is not None:
            entry["graph_us"] = graph_time(warmup, repeats)
        step_times = getattr(prepared, "time_steps", None)
        if step_times is not None:  # where a plan's time goes: one figure per kernel, beside its facts
            for facts, us in zip(entry["kernels"], step_times(repeats), strict=True):
                facts["meas_us"] = us
    except Exception as exc:
        _failed(entry, cand, "timing", exc)


def measure_candidate(
    cand: Candidate,
    executor: Executor,
    inputs: Mapping[str, np.ndarray],
    expected: tuple[list[np.ndarray], list[np.ndarray]],
    warmup: int,
    repeats: int,
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "key": cand.plan.key,
        "plan": cand.plan.notation(),
        "composition": cand.plan.composition(),
        "est_us": round(cand.est_us, 4),
        "meas_us": None,
        "samples_us": [],
        "verdict": Verdict.NOT_TIMED,
        "max_abs": None,
        "max_rel": None,
        "kernels": [],
    }
    missing = [bk.unsupported for bk in cand.kernels if bk.unsupported and executor.name != "numpy"]
    if missing:
        entry["verdict"] = rejected(missing[0])
        return entry
    try:
        prepared = executor.prepare(cand, inputs)
    except Exception as exc:  # a backend failure rejects this candidate, named, and the run goes on
        return _failed(entry, cand, "", exc)
    try:
        _verify_and_time(entry, cand, prepared, expected, warmup, repeats)
    finally:
        close = getattr(prepared, "close", None)
        if close is not None:  # free library handles whatever happened
            close()
    return entry


def time_bundle(
    bundle: Bundle,
    executor: Executor,
    *,
    warmup: int = 2,
    repeats: int = 7,
    max_candidates: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Verify then time every candidate; returns the measured JSON."""
    inputs = bundle.make_inputs()
    expected = reference_outputs(bundle, inputs)
    cands = bundle.candidates[:max_candidates] if max_candidates else bundle.candidates
    entries = []
    best: float = math.inf
    for i, cand in enumerate(cands):
        e = measure_candidate(cand, executor, inputs, expected, warmup, repeats)
        if e["meas_us"] is not None and e["meas_us"] < best:
            best = e["meas_us"]
            e["best_so_far"] = True
        entries.append(e)
        if progress:
            meas = f"{e['meas_us']:.2f} us" if e["meas_us"] is not None else "-"
            mark = " *best so far*" if e.get("best_so_far") else ""
            progress(f"[{i + 1}/{len(cands)}] {e['plan']:<12} {e['composition']:<48} est {e['est_us']:.2f} us  "
                     f"meas {meas}  {e['verdict']}{mark}")
    return {
        "schema": MEASURED_SCHEMA,
        "graph": bundle.graph,
        "graph_sha256": bundle.graph_sha256,
        "bundle_device": bundle.device,
        "machine": executor.machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "warmup": warmup,
        "repeats": repeats,
        "candidates": entries,
    }


# ---------------------------------------------------------------- reading results back


@dataclass(frozen=True)
class Measurement:
    """One candidate's measured result, keyed by ``Plan.key``."""

    key: str
    plan: str
    meas_us: float | None  # median of repeats; None when not timed
    verdict: str  # a Verdict, or "rejected: <reason>"
    samples_us: tuple[float, ...]
    kernels: tuple[dict[str, Any], ...]  # per-kernel facts from the compiled kernels
    graph_us: float | None
    executor: str


def ranks_by_graph(measurements: Mapping[str, Measurement] | list[dict[str, Any]]) -> bool:
    """Whether a file's candidates are ranked by their CUDA-graph replay time: when every timed one has it. A
    replayed graph times the GPU's work alone; the event-timed runs include each launch's host work (nvmath's
    Python call per cuBLASLt product), which dominates a launch-bound plan such as decode at M=16. Mixing the two
    would favour whichever candidates were captured, so one missing capture ranks them all by events."""
    items = list(measurements.values()) if isinstance(measurements, Mapping) else measurements
    timed = [(m.meas_us, m.graph_us) if isinstance(m, Measurement) else (m.get("meas_us"), m.get("graph_us"))
             for m in items]
    timed = [t for t in timed if t[0] is not None]
    return bool(timed) and all(g is not None for _, g in timed)


def load_measured(path: str | Path) -> dict[str, Measurement]:
    """``measured.json`` (from ``python -m backends.cupy time``) as ``{plan_key: Measurement}``."""
    p = Path(path)
    return measured_from_json(read_json(p, MeasuredError, "measured-results file"), str(p))


def measured_from_json(data: Any, source: str) -> dict[str, Measurement]:
    """A measured-results document, checked against its schema (``planner/core/schemas/measured.json``) as
    untrusted data (``source`` names it in errors)."""
    if not isinstance(data, dict) or data.get("schema") != MEASURED_SCHEMA:
        raise MeasuredError(f"{source}: not a measured-results file (schema {MEASURED_SCHEMA!r} expected)")
    check_document(data, "measured", source, MeasuredError)
    executor = str(data.get("machine", {}).get("executor", "?"))
    return {
        c["key"]: Measurement(
            key=c["key"],
            plan=c.get("plan", ""),
            meas_us=_us(c.get("meas_us")),
            verdict=c["verdict"],
            samples_us=tuple(float(s) for s in c.get("samples_us", []) if s is not None),
            kernels=tuple(dict(k) for k in c.get("kernels", [])),
            graph_us=_us(c.get("graph_us")),
            executor=executor,
        )
        for c in data["candidates"]
    }


def _us(value: float | None) -> float | None:
    return None if value is None else float(value)


def write_measured(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1))


def best_timed(result: dict[str, Any]) -> dict[str, Any] | None:
    timed = [c for c in result["candidates"] if c["meas_us"] is not None]
    return min(timed, key=lambda c: c["meas_us"]) if timed else None

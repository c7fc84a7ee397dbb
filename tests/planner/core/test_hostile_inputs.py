"""Hostile or broken inputs end in a named refusal (exit 2 from the CLI), never a traceback or a hang: a FIFO
where a file is read, JSON too deep or with numbers no float holds, huge graphs, bad environment variables,
torch-backed steps that would compute without bound or write where they must not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from testpaths import ROOT

from planner.core.graph import GraphError, graph_from_json, load_graph
from planner.core.ops import OpError
from planner.core.planfile import PlanFileError, load_plan


def cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "planner", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _graph_doc(nodes: list[dict], outputs: list[str]) -> dict:
    return {"format": "fusion-planner-graph", "version": 1, "name": "g", "nodes": nodes, "outputs": outputs}


# ---------------------------------------------------------------- files


def test_a_fifo_as_the_graph_is_refused_not_waited_on(tmp_path):
    fifo = _fifo(tmp_path / "graph.json")
    t0 = time.perf_counter()
    out = cli("explain", "--graph", str(fifo), timeout=60)
    assert out.returncode == 2 and "not a regular file" in out.stderr and "Traceback" not in out.stderr
    assert time.perf_counter() - t0 < 30
    with pytest.raises(GraphError, match="not a regular file"):
        load_graph(fifo)


def test_a_fifo_as_a_plan_cache_entry_is_skipped_and_the_plan_is_made(tmp_path):
    from planner.core.cost import load_device
    from planner.core.examples import ew_chain
    from planner.model.plancache import PlanCache
    from planner.pipeline import PlanOptions, plan_graph
    from planner.registry import get_backend
    from planner.rules.load import load_rules

    graph, spec = ew_chain(3, 64), load_device("h200")
    backend = get_backend("model", spec)
    options = PlanOptions("model", spec, tuple(load_rules()))
    cache = PlanCache(tmp_path)
    key = options.cache_key(*_whole(graph), backend)
    _fifo(cache.path(key))
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(plan_graph(graph, options, backend, cache=cache)), daemon=True)
    worker.start()
    worker.join(60)
    assert done, "planning waited on a FIFO in the plan cache"
    assert key in cache.rebuilt


def _whole(graph):
    from planner.core.regions import whole_graph_region

    return (whole_graph_region(graph),)


@pytest.mark.parametrize("text, message", [
    ("[" * 2000 + "]" * 2000, "nested too deep"),
    ('{"a": ' + "9" * 5000 + "}", "integer of 5,000 digits"),
    ('{"a": 1e400}', "not a finite float"),
    ('{"a": NaN}', "NaN is not JSON"),
    ('{"a": -Infinity}', "-Infinity is not JSON"),
])
def test_json_that_python_cannot_hold_is_refused_by_name(text, message, tmp_path):
    f = tmp_path / "g.json"
    f.write_text(text)
    with pytest.raises(GraphError, match=message):
        load_graph(f)
    with pytest.raises(PlanFileError, match=message):
        load_plan(f)
    out = cli("explain", "--graph", str(f))
    assert out.returncode == 2 and message in out.stderr and str(f) in out.stderr and "Traceback" not in out.stderr


def test_a_dimension_past_any_float_is_refused(tmp_path):
    doc = _graph_doc([{"id": "x", "op": "In", "shape": [4, "1e400"], "dtype": "fp32"},
                      {"id": "y", "op": "Relu", "inputs": ["x"], "shape": [4, 4], "dtype": "fp32"}], ["y"])
    with pytest.raises(GraphError):
        graph_from_json(doc)
    f = tmp_path / "g.json"
    f.write_text(json.dumps(doc).replace('"1e400"', "1e400"))
    out = cli("explain", "--graph", str(f))
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_a_graph_of_100k_inputs_is_explained_in_seconds_or_refused(tmp_path):
    n = 100_000
    nodes = [{"id": f"x{i}", "op": "In", "shape": [2], "dtype": "fp32"} for i in range(n)]
    acc = "x0"
    for i in range(1, 64):
        nodes.append({"id": f"a{i}", "op": "Add", "inputs": [acc, f"x{i}"], "shape": [2], "dtype": "fp32"})
        acc = f"a{i}"
    f = tmp_path / "wide.json"
    f.write_text(json.dumps(_graph_doc(nodes, [acc])))
    t0 = time.perf_counter()
    out = cli("explain", "--graph", str(f), "--json", timeout=120)
    assert time.perf_counter() - t0 < 30, "100,000 inputs took longer than 30 s to explain"
    assert out.returncode in (0, 2) and "Traceback" not in out.stderr, out.stderr[-2000:]


# ---------------------------------------------------------------- environment


@pytest.mark.parametrize("var, value", [("FUSION_PLANNER_CC_TIMEOUT", "abc"), ("FUSION_PLANNER_THREADS", "two"),
                                        ("FUSION_PLANNER_CPU_GEMM", "blas"), ("FUSION_PLANNER_MAX_NODES", "-3")])
def test_a_bad_environment_variable_is_a_usage_error_naming_it(var, value):
    out = cli("plan", "--example", "ew-chain", "--k", "2", "--n", "64", "--backend", "cpu", "--no-cache",
              env={var: value})
    assert out.returncode == 2 and var in out.stderr and "Traceback" not in out.stderr, out.stderr[-1500:]


# ---------------------------------------------------------------- torch-backed steps


def _step(impl: str, args: list, kwargs: dict | None = None, **extra: object) -> dict:
    return {"impl": impl, "args": args, "kwargs": {"$dict": kwargs or {}}, "item": -1, "shapes": [], "out": [4, 4],
            **extra}


def _opaque_graph(*steps: dict) -> dict:
    call = json.dumps({"steps": list(steps), "in": [[4, 4]], "out": [4, 4]})
    return _graph_doc([{"id": "x", "op": "In", "shape": [4, 4], "dtype": "fp32"},
                       {"id": "y", "op": "Opaque", "inputs": ["x"], "attrs": {"impl": "torch.softmax", "call": call},
                        "shape": [4, 4], "dtype": "fp32"}], ["y"])


SOFTMAX = _step("torch.softmax", [{"$in": 0}, -1])

REFUSED_ON_LOAD = {
    "out= into the planner's buffers": _opaque_graph(_step("torch.softmax", [{"$in": 0}, -1], {"out": {"$in": 0}})),
    "a raw device name": _opaque_graph(_step("torch.zeros_like", [{"$in": 0}], {"device": "cuda"})),
    "a device name as an argument": _opaque_graph(_step("torch.Tensor.to", [{"$in": 0}, "meta"])),
    "a step without its out shape": _opaque_graph({k: v for k, v in SOFTMAX.items() if k != "out"}),
    "non-numeric shapes": _opaque_graph({**SOFTMAX, "shapes": [["four", 4]]}),
    "a huge integer": _opaque_graph(_step("torch.softmax", [{"$in": 0}, 2**70])),
}


@pytest.mark.parametrize("name", sorted(REFUSED_ON_LOAD))
def test_malformed_or_hostile_steps_are_refused_when_loaded(name, tmp_path):
    doc = REFUSED_ON_LOAD[name]
    with pytest.raises((GraphError, OpError)):
        graph_from_json(doc)
    f = tmp_path / "g.json"
    f.write_text(json.dumps(doc))
    out = cli("explain", "--graph", str(f))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-1500:]


REFUSED_WHEN_RUN = {
    "a power of a billion": (_step("torch.operator.pow", [10, 10**9], out=[]), "exponent at most"),
    "four billion list items": (_step("torch.operator.mul", [[0], 4_000_000_000], out=[]), "repeating a Python sequence"),
    "a division by zero": (_step("torch.operator.floordiv", [1, 0], out=[]), "ZeroDivisionError"),
}


@pytest.mark.parametrize("name", sorted(REFUSED_WHEN_RUN))
def test_scalar_steps_are_bounded_and_every_failure_is_a_named_op_error(name, tmp_path):
    pytest.importorskip("torch")
    step, message = REFUSED_WHEN_RUN[name]
    doc = _opaque_graph(step, _step("torch.softmax", [{"$in": 0}, -1]))
    f = tmp_path / "g.json"
    f.write_text(json.dumps(doc))
    t0 = time.perf_counter()
    out = cli("plan", "--graph", str(f), "--backend", "reference", "--no-cache", timeout=120)
    assert time.perf_counter() - t0 < 60
    assert out.returncode in (1, 2) and message in out.stderr and "step 0" in out.stderr, out.stderr[-1500:]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["inputs"].__setitem__("seed", -1), "inputs.seed must be bigger than or equal to 0"),
    (lambda d: d["inputs"].__setitem__("scales", {k: 0.0 for k in d["inputs"]["names"]}), "must be bigger than 0"),
])
def test_a_bundle_with_a_bad_seed_or_zero_scales_is_refused_by_the_runner(edit, message, tmp_path):
    bundle = tmp_path / "b.json"
    out = cli("export-candidates", "--example", "ew-chain", "--k", "2", "--n", "64", "-o", str(bundle))
    assert out.returncode == 0, out.stderr
    doc = json.loads(bundle.read_text())
    edit(doc)
    bundle.write_text(json.dumps(doc))
    run = subprocess.run([sys.executable, "-m", "backends.cupy", "time", str(bundle), "-o", str(tmp_path / "m.json"),
                          "--executor", "numpy"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr[-1500:]

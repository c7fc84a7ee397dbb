"""Hostile graph files: every mutation either loads or is refused with a named error, never a traceback."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.core.cost import load_device
from planner.core.examples import ew_chain, heavy, mlp_epilogue, transformer
from planner.core.graph import Graph, GraphBuilder, GraphError, graph_from_json
from planner.core.inputs import random_inputs
from planner.core.reference import execute_graph
from planner.egraph.candidates import build_candidates
from planner.egraph.program import Limits
from planner.errors import USER_ERRORS


def _opaque_block() -> Graph:
    """A LayerNorm and a causal attention as the built-in Opaque implementations (the example graphs write
    them in op-table primitives now)."""
    b = GraphBuilder("opaque-block")
    b.input("x", (4, 16), "fp32")
    b.input("g", (16,), "fp32")
    b.input("beta", (16,), "fp32")
    h = b.op("ln", "Opaque", ["x", "g", "beta"], {"impl": "layer_norm", "eps": 1e-5})
    return b.build([b.op("attn", "Opaque", [h, h, h], {"impl": "attention", "heads": 2, "causal": 1})])


SEEDS = [
    json.loads(g.dumps())
    for g in (ew_chain(3, 64), heavy(64), mlp_epilogue(8, 16, 8, "fp32"), transformer(1, 16, 4, "fp32"),
              _opaque_block())
]
OPAQUE_SEED = 4

#: values a careless or hostile file puts anywhere
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1e18, 2**63, 2**64, math.inf, "", "x", "\udc80", "fp32", "In",
                     "Opaque", "torch.os.system", "layer_norm", "attention", "Relu"]),
    st.lists(st.integers(-3, 2**40), max_size=6), st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    st.lists(st.lists(st.text(max_size=3), max_size=2), max_size=2),
)


def _paths(doc, prefix=()):
    """Every (container, key) pair inside a JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield prefix, doc, k
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield prefix, doc, i
            yield from _paths(v, (*prefix, i))


def _mutate(draw, seeds):  # noqa: ANN001, ANN202
    """One of ``seeds``, one to three places replaced by junk, deleted or duplicated."""
    doc = copy.deepcopy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 3))):
        _, container, key = draw(st.sampled_from(list(_paths(doc))))
        action = draw(st.sampled_from(["replace", "delete", "duplicate"]))
        if action == "replace":
            container[key] = draw(JUNK)
        elif action == "delete" and isinstance(container, dict):
            del container[key]
        elif action == "duplicate" and isinstance(container, list) and container:
            container.insert(draw(st.integers(0, len(container))), copy.deepcopy(container[key]))
    return doc


@st.composite
def mutated(draw):
    return _mutate(draw, SEEDS)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(mutated())
def test_mutated_graph_files_load_or_are_refused_by_name(doc):
    try:
        graph = graph_from_json(doc, "fuzz.json")
    except USER_ERRORS as exc:
        assert str(exc).startswith("fuzz.json") or "node" in str(exc) or "graph" in str(exc), exc
        return
    # a graph that loads can be planned and executed (small limits keep the case fast)
    try:
        cands = build_candidates(graph, load_device("h200"), limits=Limits(max_iterations=4, max_nodes=5000, time_limit_s=5),
                                 cap=16, k=4)
        execute_graph(graph, random_inputs(graph, 0))
        assert cands.plans
    except USER_ERRORS:
        pass


CRASHERS = {
    # the signatures found by mutating valid graphs (issue: reliability), each now a named refusal
    "op is a dict": lambda d: d["nodes"][1].__setitem__("op", {"a": 1}),
    "dtype is a list": lambda d: d["nodes"][0].__setitem__("dtype", ["fp32"]),
    "inputs is an int": lambda d: d["nodes"][1].__setitem__("inputs", 3),
    "outputs nested": lambda d: d.__setitem__("outputs", [["x"]]),
    "outputs of dicts": lambda d: d.__setitem__("outputs", [{"a": 1}]),
    "name with a lone surrogate": lambda d: d.__setitem__("name", "a\udc80b"),
    "name is a dict": lambda d: d.__setitem__("name", {"a": 1}),
    "shape 1e18": lambda d: d["nodes"][0].__setitem__("shape", [10**18]),
    "shape 2^64": lambda d: d["nodes"][0].__setitem__("shape", [2**64]),
    "rank 4096": lambda d: d["nodes"][0].__setitem__("shape", [1] * 4096),
    "In with attrs": lambda d: d["nodes"][0].__setitem__("attrs", {"a": 1}),
    "version true": lambda d: d.__setitem__("version", True),
}


@pytest.mark.parametrize("name", sorted(CRASHERS))
def test_each_crash_signature_is_a_named_refusal(name):
    doc = copy.deepcopy(SEEDS[0])
    CRASHERS[name](doc)
    with pytest.raises(USER_ERRORS):
        graph_from_json(doc, "crash.json")


@pytest.mark.parametrize(
    "attr, value",
    [("heads", [2]), ("heads", 0), ("heads", -1), ("heads", math.inf), ("heads", None), ("heads", "x"),
     ("heads", True), ("causal", "yes"), ("eps", "abc"), ("eps", math.nan)],
)
def test_built_in_opaque_attributes_are_checked(attr, value):
    doc = copy.deepcopy(SEEDS[OPAQUE_SEED])
    impl = "attention" if attr in ("heads", "causal") else "layer_norm"
    node = next(n for n in doc["nodes"] if n.get("attrs", {}).get("impl") == impl)
    node["attrs"][attr] = value
    with pytest.raises(GraphError, match=attr):
        graph_from_json(doc, "attrs.json")


def test_an_integer_attribute_of_infinity_is_refused():
    doc = json.loads(heavy(64).dumps())
    stage = next(n for n in doc["nodes"] if n["op"] == "Stage")
    stage["attrs"]["flops"] = math.inf
    with pytest.raises(GraphError, match="flops"):
        graph_from_json(doc, "inf.json")


def test_a_norm_without_inputs_is_refused():
    doc = copy.deepcopy(SEEDS[OPAQUE_SEED])
    node = next(n for n in doc["nodes"] if n.get("attrs", {}).get("impl") == "layer_norm")
    node["inputs"] = []
    with pytest.raises(GraphError, match="norm"):
        graph_from_json(doc, "norm.json")


# ---------------------------------------------------------------- plan files


def _plan_seeds() -> list[dict]:
    from planner.core.cost import load_device
    from planner.core.planfile import plan_document

    spec = load_device("h200")
    out = []
    for g in (ew_chain(3, 64), mlp_epilogue(8, 16, 8, "fp32"), transformer(1, 16, 4, "fp32")):
        cands = build_candidates(g, spec, cap=16, k=4)
        out += [plan_document(p, g, spec, {"backend": "fuzz"}) for p in (cands.best, cands.unfused)]
    return out


PLAN_SEEDS = _plan_seeds()


@st.composite
def mutated_plan(draw):
    """A saved plan mutated as a hostile author would, the content hash recomputed so the checks behind it run."""
    from planner.core.planfile import content_hash

    doc = _mutate(draw, PLAN_SEEDS)
    if isinstance(doc, dict) and draw(st.booleans()):
        doc["sha256"] = content_hash(doc)
    return doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(mutated_plan())
def test_mutated_plan_files_load_or_are_refused_by_name(doc):
    from planner.backend import BackendError
    from planner.core.planfile import plan_from_document
    from planner.core.reference import execute_plan

    try:
        plan, graph, _, _ = plan_from_document(doc, "fuzz-plan.json")
    except USER_ERRORS as exc:
        assert "fuzz-plan.json" in str(exc), exc
        return
    try:  # a plan that loads runs on the reference executor, or is refused by name
        execute_plan(plan, random_inputs(graph, 0))
    except (*USER_ERRORS, BackendError):
        pass


# ---------------------------------------------------------------- bundles and measured results (the GPU round trip)


def _bundle_seeds() -> list[dict]:
    from backends.cupy.bundle import export_bundle

    return [json.loads(json.dumps(export_bundle(build_candidates(g, load_device("h200"), cap=8, k=4))))
            for g in (ew_chain(2, 64), mlp_epilogue(8, 16, 8, "fp32"))]


BUNDLE_SEEDS = _bundle_seeds()
MEASURED_SEED = {
    "schema": "fusion-planner/measured/1", "machine": {"executor": "cupy"},
    "candidates": [{"key": "k1", "plan": "[3]", "verdict": "timed", "meas_us": 12.5, "samples_us": [12.0, 13.0],
                    "kernels": [{"regs": 32}], "graph_us": 10.0},
                   {"key": "k2", "plan": "[1,1,1]", "verdict": "rejected: x", "meas_us": None}],
}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(st.data())
def test_mutated_bundles_load_or_are_refused_by_name(data):
    from backends.cupy.bundle import BundleError, bundle_from_json

    doc = _mutate(data.draw, BUNDLE_SEEDS)
    try:
        bundle_from_json(doc, "fuzz-bundle.json")
    except (BundleError, *USER_ERRORS) as exc:
        assert "fuzz-bundle.json" in str(exc) or isinstance(exc, USER_ERRORS), exc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(st.data())
def test_mutated_measured_files_load_or_are_refused_by_name(data):
    from backends.cupy.runner import MEASURED_SCHEMA, MeasuredError, measured_from_json

    assert MEASURED_SEED["schema"] == MEASURED_SCHEMA
    doc = _mutate(data.draw, [MEASURED_SEED])
    try:
        out = measured_from_json(doc, "fuzz-measured.json")
    except MeasuredError as exc:
        assert str(exc).startswith("fuzz-measured.json"), exc
        return
    for m in out.values():  # what loads is usable: finite positive times only
        assert m.meas_us is None or (math.isfinite(m.meas_us) and m.meas_us > 0)
        assert all(math.isfinite(s) and s > 0 for s in m.samples_us)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["device"]["matmul_tflops"].update(fp16=None), "matmul_tflops"),
    (lambda d: d["device"].update(launch_us="3"), "launch_us"),
    (lambda d: d["device"].update(sm_count=True), "sm_count"),
    (lambda d: d["plan"]["kernels"][0]["body"].update(args=7), "'args' as a list"),
    (lambda d: d["plan"]["kernels"][0]["body"].update(attrs=[1]), "'attrs' as an object"),
    (lambda d: d["plan"]["kernels"][0]["body"].update(shape=[8, True]), "non-negative integers"),
])
def test_plan_file_crash_signatures_are_named_refusals(edit, message):
    """Signatures the fuzz tests found: each is now a refusal naming the file."""
    from planner.core.planfile import content_hash, plan_from_document

    doc = copy.deepcopy(PLAN_SEEDS[0])
    edit(doc)
    doc["sha256"] = content_hash(doc)
    with pytest.raises(USER_ERRORS, match=message):
        plan_from_document(doc, "sig.json")


def test_a_body_whose_recorded_shape_its_operands_do_not_give_is_refused():
    from planner.core.planfile import PlanFileError, content_hash, plan_from_document

    doc = copy.deepcopy(PLAN_SEEDS[2])  # mlp-epilogue's fused plan: a GEMM body
    body = doc["plan"]["kernels"][0]["body"]
    inner = body
    while "args" in inner and not any("load" in a for a in inner["args"]):
        inner = inner["args"][0]
    inner["shape"] = [8, 8]  # the MatMul of x [8,8] @ w [8,16] recorded as [8,8]
    doc["sha256"] = content_hash(doc)
    with pytest.raises(PlanFileError, match="sig.json"):
        plan_from_document(doc, "sig.json")


CLI_CHILD = r"""
import contextlib, io, json, os, resource, signal, sys, tempfile
cap, timeout = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from planner.cli import main
from planner.core.graph import load_graph
from planner.core.reference import execute_graph, random_inputs
from planner.errors import USER_ERRORS
from planner.torch import need_evaluator


def reference(path):
    # the graph run on the numpy reference directly, as `run` and the composite check do: 0, or 2 for a
    # named refusal; anything else escapes
    try:
        graph = load_graph(path)
        need_evaluator(graph)
        execute_graph(graph, random_inputs(graph, 0))
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0

class Hang(Exception):
    pass

def alarm(*_):
    raise Hang()

signal.signal(signal.SIGALRM, alarm)
results = []
folder = tempfile.mkdtemp()
for i, doc in enumerate(json.load(open(sys.argv[3]))):
    path = os.path.join(folder, f"case{i}.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    for cmd in (["explain", "--graph", path], ["reference", path],
                ["plan", "--graph", path, "--backend", "reference", "--no-cache", "--max-candidates", "2"]):
        err = io.StringIO()
        signal.alarm(timeout)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                rc = reference(cmd[1]) if cmd[0] == "reference" else main(cmd)
        except Hang:
            rc = "hang"
        except SystemExit as exc:
            rc = exc.code
        except BaseException as exc:
            rc = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            signal.alarm(0)
        if "Traceback" in err.getvalue():
            rc = "traceback: " + err.getvalue()[-300:]
        results.append([i, cmd[0], rc])
print(json.dumps(results))
"""


def _through_the_cli(cases: list[dict], tmp_path) -> None:
    """Each case as a user runs it (explain, then plan on the reference backend), in one child process
    under an address-space cap, with a per-case alarm: exit 0, 1 or 2, never a traceback or a hang."""
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    cap, per_case = 6 * 2**30, 60
    done = subprocess.run([sys.executable, "-c", CLI_CHILD, str(cap), str(per_case), str(tmp_path / "cases.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 3 * len(cases)
    bad = [r for r in results if r[2] not in (0, 1, 2)]
    assert not bad, bad[:5]


def _collect(strategy, n: int) -> list[dict]:
    cases: list[dict] = []

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(strategy)
    def collect(doc):
        cases.append(doc)

    collect()
    return cases


def test_mutated_graphs_through_the_cli_end_in_0_1_or_2_without_hang_under_a_memory_cap(tmp_path):
    _through_the_cli(_collect(mutated(), 100), tmp_path)


# ---------------------------------------------------------------- torch-backed call steps

#: steps of a torch-backed Opaque node as the importer records them, to mutate
STEP_SEEDS = [
    {"impl": "torch.softmax", "args": [{"$in": 0}, -1], "kwargs": {"$dict": {}}, "item": -1, "shapes": [[4, 8]],
     "out": [4, 8]},
    {"impl": "torch.nn.functional.layer_norm", "args": [{"$in": 0}, {"$tuple": [8]}],
     "kwargs": {"$dict": {"eps": 1e-5}}, "item": -1, "shapes": [[4, 8]], "out": [4, 8]},
    {"impl": "torch.operator.mul", "args": [{"$in": 0}, 2.0], "kwargs": {"$dict": {}}, "item": -1, "shapes": [[4, 8]],
     "out": [4, 8]},
    {"impl": "torch.zeros_like", "args": [{"$in": 0}], "kwargs": {"$dict": {"device": {"$device": "cpu"}}},
     "item": -1, "shapes": [[4, 8]], "out": [4, 8]},
]
#: what a hostile file puts into a step
STEP_JUNK = st.one_of(
    JUNK, st.sampled_from([
        {"$in": 0}, {"$in": 7}, {"$step": 0}, {"$device": "cuda"}, "cuda", "meta", "cuda:1", {"$dtype": "float64"},
        {"$tensor": {"dtype": "float32", "shape": [2], "data": [1.0, 2.0]}}, [0] * 3, 10**9, -(2**63),
        "torch.operator.pow", "torch.operator.mul", "torch.operator.floordiv", "torch.Tensor.to", "torch.full_like",
        {"$dict": {"out": {"$in": 0}}}, {"$slice": [0, None, 0]}, {"$ellipsis": None},
    ]),
)
#: steps of Python-number arithmetic a file could ask for: unbounded, or raising what torch calls do not
SCALAR_STEPS = [
    {"impl": f"torch.operator.{op}", "args": args, "kwargs": {"$dict": {}}, "item": -1, "shapes": [], "out": []}
    for op, args in (("floordiv", [1, 0]), ("mod", [7, 0]), ("pow", [10, 10**9]), ("mul", [[0], 4 * 10**9]),
                     ("truediv", [1.0, 0]), ("pow", [2.0, 4096.0]), ("mul", [2**62, 2**62]))
]


@st.composite
def mutated_steps(draw):
    """A graph of one torch-backed node whose call is one to three mutated steps (the last must give the value)."""
    steps = [copy.deepcopy(draw(st.sampled_from(STEP_SEEDS))) for _ in range(draw(st.integers(1, 3)))]
    if draw(st.booleans()):
        steps.insert(draw(st.integers(0, len(steps) - 1)), copy.deepcopy(draw(st.sampled_from(SCALAR_STEPS))))
    for _ in range(draw(st.integers(0, 2))):
        _, container, key = draw(st.sampled_from(list(_paths(steps))))
        if draw(st.booleans()):
            container[key] = draw(STEP_JUNK)
        elif isinstance(container, dict):
            del container[key]
    call = json.dumps({"steps": steps, "in": [[4, 8]], "out": [4, 8]})
    return {"format": "fusion-planner-graph", "version": 1, "name": "steps",
            "nodes": [{"id": "x", "op": "In", "shape": [4, 8], "dtype": "fp32"},
                      {"id": "y", "op": "Opaque", "inputs": ["x"], "attrs": {"impl": "torch.softmax", "call": call},
                       "shape": [4, 8], "dtype": "fp32"},
                      {"id": "z", "op": "Relu", "inputs": ["y"], "shape": [4, 8], "dtype": "fp32"}],
            "outputs": ["z"]}


def test_mutated_torch_steps_through_the_cli_end_in_0_1_or_2_without_hang_under_a_memory_cap(tmp_path):
    """Torch-backed steps from a file are checked before they run, bounded when they run, and any failure of
    theirs is an OpError naming the step: no traceback, no hang, whatever a file puts into them."""
    pytest.importorskip("torch")
    _through_the_cli(_collect(mutated_steps(), 80), tmp_path)

"""A graph, plan or bundle file never runs code: torch names resolve only from an exact allowlist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from testpaths import ROOT

from planner.core.graph import GraphError, graph_from_json
from planner.core.ops import OpError
from planner.core.torch_allowlist import TORCH_CALLABLES, check_torch_call

#: names an attacker builds from allowed prefixes through re-exported modules
HOSTILE_NAMES = [
    "torch.nn.functional.torch.os.system",
    "torch.os.system",
    "torch.nn.functional.torch.load",
    "torch._C._nn.torch.os.system",
    "torch._C._VariableFunctions.os.system",
    "torch.ops.aten.os.system.default",
    "torch.ops.builtins.eval.default",
    "torch.ops.os.system.default",
    "builtins.eval",
    "os.system",
    "torch.load",
    "torch.save",
    "torch.hub.load",
    "torch.Tensor.numpy",
    "torch.Tensor.__reduce_ex__",
    "torch.Tensor.__class__",
    "torch.operator.setitem",
    "torch.operator.attrgetter",
    "torch.ops.aten.softmax.int_out",
    "torch._dynamo.reset",
]


def _call(step_impl: str, args: list, *, kwargs: dict | None = None) -> str:
    step = {"impl": step_impl, "args": args, "kwargs": {"$dict": kwargs or {}}, "item": -1, "shapes": [], "out": [4, 4]}
    return json.dumps({"steps": [step], "in": [[4, 4]], "out": [4, 4]})


def _graph(impl: str, call: str) -> dict:
    return {
        "format": "fusion-planner-graph", "version": 1, "name": "hostile",
        "nodes": [
            {"id": "x", "op": "In", "shape": [4, 4], "dtype": "fp32"},
            {"id": "y", "op": "Opaque", "inputs": ["x"], "attrs": {"impl": impl, "call": call},
             "shape": [4, 4], "dtype": "fp32"},
        ],
        "outputs": ["y"],
    }


def _payloads(marker: Path) -> dict[str, dict]:
    """One graph per path that names an object; each would create ``marker`` if anything ran."""
    cmd = f"touch {marker}"
    softmax = _call("torch.softmax", [{"$in": 0}, -1])
    return {
        "step impl": _graph("torch.softmax", _call("torch.nn.functional.torch.os.system", [cmd])),
        "node impl": _graph("torch.nn.functional.torch.os.system", softmax),
        "dtype tag": _graph("torch.softmax", _call("torch.softmax", [{"$in": 0}, -1], kwargs={"dtype": {"$dtype": "os"}})),
        "nested dtype": _graph("torch.softmax", _call("torch.softmax", [{"$in": 0}, {"$tuple": [{"$dtype": "load"}]}])),
        "memory format": _graph("torch.softmax", _call("torch.softmax", [{"$in": 0}, -1],
                                                        kwargs={"x": {"$memory_format": "save"}})),
        "layout": _graph("torch.softmax", _call("torch.softmax", [{"$in": 0}], kwargs={"x": {"$layout": "hub"}})),
        "tensor dtype": _graph("torch.softmax", _call("torch.softmax", [
            {"$tensor": {"dtype": "os", "shape": [1], "data": [0]}}])),
        "re-exported torch": _graph("torch.softmax", _call("torch.nn.functional.torch.load", [cmd])),
        "torch._C": _graph("torch.softmax", _call("torch._C._nn.torch.os.system", [cmd])),
        "torch.ops namespace": _graph("torch.softmax", _call("torch.ops.os.system.default", [cmd])),
        "builtins": _graph("torch.softmax", _call("builtins.exec", [f"open({str(marker)!r}, 'w')"])),
    }


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_names_are_refused_by_the_check(name: str) -> None:
    assert name not in TORCH_CALLABLES
    with pytest.raises(OpError, match="refused"):
        check_torch_call("torch.softmax", _call(name, []))


def test_every_payload_is_refused_on_load_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for what, doc in _payloads(marker).items():
        with pytest.raises(GraphError) as info:
            graph_from_json(doc, f"{what}.json")
        assert f"{what}.json" in str(info.value) and "node 'y'" in str(info.value), what
        assert "refused" in str(info.value), (what, str(info.value))
    assert not marker.exists()


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "planner", *argv], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_cli_and_api_refuse_the_same_file_alike(tmp_path: Path, backend: str) -> None:
    pytest.importorskip("torch")
    import planner

    marker = tmp_path / "ran"
    path = tmp_path / "evil.json"
    path.write_text(json.dumps(_payloads(marker)["step impl"]))
    proc = _cli("plan", "--graph", str(path), "--backend", backend)
    assert proc.returncode == 2, proc.stderr
    assert str(path) in proc.stderr and "node 'y'" in proc.stderr and "torch.nn.functional.torch.os.system" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(GraphError) as info:
        planner.plan(str(path), backend=backend)
    assert str(info.value) in proc.stderr
    assert not marker.exists()


def test_a_refused_name_is_never_imported(tmp_path: Path) -> None:
    """Checking a name does not look it up: torch's lazily imported submodules stay unimported."""
    pytest.importorskip("torch")
    path = tmp_path / "lazy.json"
    path.write_text(json.dumps(_graph("torch.softmax", _call("torch._dynamo.reset", []))))
    code = (
        "import sys, planner.torch.ops; from planner.core.graph import load_graph\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        f"try:\n    load_graph({str(path)!r})\nexcept Exception as e:\n    print(type(e).__name__)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.split() == ["GraphError", "False"], out.stderr


def test_plan_files_and_bundles_are_checked_too(tmp_path: Path) -> None:
    """A kernel body in plan.json or a bundle names torch calls as well: checked on load."""
    from backends.cupy.bundle import BundleError, bundle_from_json
    from planner.core.plans import expr_from_json

    body = {"op": "Opaque", "node": "y", "attrs": {"impl": "torch.softmax",
                                                   "call": _call("torch.os.system", ["true"])},
            "args": [{"load": "x"}], "shape": [4, 4], "dtype": "fp32"}
    with pytest.raises(OpError, match="node 'y'.*torch.os.system"):
        expr_from_json(body)
    with pytest.raises((BundleError, OpError)):
        bundle_from_json({"schema": "fusion-planner/candidates/1", "graph": "g", "tensors": {},
                          "inputs": {"names": [], "seed": 0},
                          "reference": {"key": "r", "outputs": ["y"],
                                        "kernels": [{"kind": "opaque", "out": "y", "reads": ["x"], "body": body}]},
                          "candidates": [], "outputs": ["y"]})


def test_call_descriptions_are_checked_for_structure() -> None:
    ok = _call("torch.softmax", [{"$in": 0}, -1])
    assert check_torch_call("torch.softmax", ok)["steps"][0]["impl"] == "torch.softmax"
    bad = [
        _call("torch.softmax", [{"$in": 3}]),  # input out of range
        _call("torch.softmax", [{"$step": 0}]),  # a step refers to itself
        _call("torch.softmax", [{"$eval": "1"}]),  # unknown tag
        _call("torch.softmax", [{"$in": 0, "$step": 0}]),  # two tags
        _call("torch.softmax", [2**70]),  # an integer beyond 64 bits
        json.dumps({"steps": [], "in": [], "out": [1]}),
        "not json",
    ]
    deep: object = 0
    for _ in range(40):
        deep = [deep]
    bad.append(_call("torch.softmax", [deep]))
    for text in bad:
        with pytest.raises(OpError):
            check_torch_call("torch.softmax", text)


# ---------------------------------------------------------------- torch side


def test_the_allowlist_is_what_the_importer_can_emit() -> None:
    pytest.importorskip("torch")
    from planner.torch.ops import derived_allowlist, resolve_canonical, torch_fn_name

    assert derived_allowlist() == TORCH_CALLABLES
    for name in TORCH_CALLABLES:  # every name resolves, and back to itself
        fn = resolve_canonical(name)
        target = name.removeprefix("torch.Tensor.") if name.startswith("torch.Tensor.") else fn
        assert torch_fn_name(target) == name


def test_allow_torch_ops_takes_only_canonical_names() -> None:
    torch = pytest.importorskip("torch")
    from planner.torch.ops import allow_torch_ops, resolve_torch_fn

    for name in HOSTILE_NAMES:
        with pytest.raises(OpError):
            resolve_torch_fn(name)
    for name in ("torch.nn.functional.torch.os.system", "torch.os.system", "torch.nn.functional.torch.logsumexp",
                 "torch", "torch.nn.functional", "torch.Tensor", "torch.ops.aten.softmax"):
        with pytest.raises(OpError, match="canonical"):
            allow_torch_ops([name])
    assert allow_torch_ops(["torch.nn.functional.hardtanh"]) == ["torch.nn.functional.hardtanh"]
    assert resolve_torch_fn("torch.nn.functional.hardtanh") is torch.nn.functional.hardtanh


def test_a_trusted_module_keeps_an_unlisted_op_and_its_saved_plan_needs_an_opt_in(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import planner

    class LogSumExp(torch.nn.Module):
        def forward(self, x):
            return torch.logsumexp(x, dim=-1, keepdim=True) * 2.0

    assert "torch.logsumexp" not in TORCH_CALLABLES
    m, x = LogSumExp(), torch.randn(4, 8)
    result = planner.plan(m, (x,), backend="reference")
    torch.testing.assert_close(result(x), m(x))
    out = result.save(tmp_path / "saved")
    with pytest.raises(GraphError, match="in-process trace.*--allow-torch-op torch.logsumexp"):
        graph_from_json(json.loads((out / "graph.json").read_text()), "graph.json")  # strict in this process too
    refused = _cli("run", str(out / "plan.json"))
    assert refused.returncode == 2 and "torch.logsumexp" in refused.stderr and "plan.json" in refused.stderr, refused.stderr
    allowed = _cli("run", str(out / "plan.json"), "--allow-torch-op", "torch.logsumexp")
    assert allowed.returncode == 0, allowed.stderr

"""The graph IR and its JSON form, and how the CLI reports bad graphs, devices and rule files."""

import json
import subprocess
import sys

import pytest
from testpaths import ROOT

from planner.core.examples import mlp_epilogue
from planner.core.graph import GraphBuilder, GraphError, graph_from_json


def test_graph_json_round_trip():
    g = mlp_epilogue(8, 4, 4, "bf16")
    g2 = graph_from_json(json.loads(g.dumps()))
    assert g2.to_json() == g.to_json()
    assert g2.is_chain()


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d["nodes"][4].update(op="Conv9"), "unknown op 'Conv9'"),
        (lambda d: d["nodes"][1].update(shape=[5, 4]), "node 'mm'"),
        (lambda d: d["nodes"][5].update(inputs=["res", "b"]), "cycle"),
        (lambda d: d.update(nodes=d["nodes"][:4]), "empty"),
        (lambda d: d["nodes"][0].pop("id"), r"nodes\[0\] must contain \['id'\] properties"),
        (lambda d: d.update(outputs=["nope"]), "output 'nope'"),
        (lambda d: d["nodes"][6].update(attrs={"zz": 1}), "unknown attribute"),
    ],
)
def test_bad_graphs_name_the_culprit(mutate, needle):
    d = json.loads(mlp_epilogue(8, 4, 4).dumps())
    mutate(d)
    with pytest.raises(GraphError, match=needle):
        graph_from_json(d)


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "planner", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_cli_bad_input_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        ["explain", "--graph", str(bad)],
        ["explain", "--graph", str(tmp_path / "missing.json")],
        ["explain", "--example", "mlp-epilogue", "--device", "no-such-device"],
        ["explain", "--example", "ew-chain", "--k", "0"],
    ]
    for args in cases:
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr


def test_cli_user_rules_must_be_rules_only(tmp_path):
    f = tmp_path / "evil.egg"
    f.write_text('(rewrite (Relu x) (Relu x))\n(input Foo "/etc/passwd")\n')
    r = _cli("explain", "--example", "heavy", "--rules", str(f))
    assert r.returncode == 2
    assert "evil.egg:2" in r.stderr


def test_explain_json_schema():
    r = _cli("explain", "--example", "mlp-epilogue", "--m", "16", "--device", "seed-k4", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    cands = data["candidates"]
    assert len(cands) == 15 and sum(c["best"] for c in cands) == 1
    for c in cands:
        assert set(c) >= {"partition", "kernels", "bytes", "launches", "reg_peak", "est_us", "best"}
        for k in c["kernels"]:
            assert k["kind"] in ("elementwise", "gemm_epilogue", "cublaslt", "opaque")
            assert set(k) >= {"ops", "bytes", "flops", "regs", "est_us"}
        assert sum(k["bytes"] for k in c["kernels"]) == c["bytes"]


_NODES_X = [{"id": "x", "op": "In", "shape": [4, 4], "dtype": "fp32"}]


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("malformed.json", "{bad", "malformed JSON at line 1"),
        ("unknown.json", {"nodes": [*_NODES_X, {"id": "y", "op": "Frob", "inputs": ["x"]}], "outputs": ["y"]}, "node 'y': unknown op 'Frob'"),
        ("shape.json", {"nodes": [*_NODES_X, {"id": "w", "op": "In", "shape": [8, 4], "dtype": "fp32"}, {"id": "y", "op": "MatMul", "inputs": ["x", "w"]}], "outputs": ["y"]}, "node 'y': MatMul"),
        ("cycle.json", {"nodes": [*_NODES_X, {"id": "a", "op": "Relu", "inputs": ["b"]}, {"id": "b", "op": "Relu", "inputs": ["a"]}], "outputs": ["b"]}, "cycle"),
        ("empty.json", {"nodes": _NODES_X, "outputs": ["x"]}, "is empty"),
        ("binary.json", b"\xff\xfe{}", "not UTF-8"),
    ],
)
def test_cli_bad_graph_files_exit_2_naming_the_culprit(tmp_path, capsys, name, content, needle):
    from planner.cli import main

    f = tmp_path / name
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["explain", "--graph", str(f)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flag", ["--device", "--rules"])
def test_cli_non_utf8_device_or_rule_file_exits_2(tmp_path, capsys, flag):
    from planner.cli import main

    f = tmp_path / "binary.txt"
    f.write_bytes(b"\xff\xfe")
    assert main(["explain", "--example", "heavy", flag, str(f)]) == 2
    err = capsys.readouterr().err
    assert str(f) in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("attrs", "needle"),
    [({"flops": 1e300}, "64-bit integer"), ({"regs": -5}, "'regs' must be at least 0"), ({"temps": 1.5}, "64-bit integer")],
)
def test_integer_attributes_are_range_checked(attrs, needle):
    b = GraphBuilder("stage")
    b.input("x", (4,), "fp32")
    with pytest.raises(GraphError, match=needle):
        b.op("y", "Stage", ["x"], attrs)
        b.build(["y"])


def test_the_example_of_the_format_page_loads():
    """docs/graph-format.md's example is a graph file as printed."""
    page = (ROOT / "docs" / "graph-format.md").read_text()
    example = page.split("```json\n", 1)[1].split("```", 1)[0]
    graph = graph_from_json(json.loads(example), "docs/graph-format.md")
    assert graph.name == "mlp-epilogue" and graph.outputs == ("ln",)

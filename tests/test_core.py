"""Graph IR, extraction and CLI behaviour of the core planner."""

import json
import subprocess
import sys

import numpy as np
import pytest

from fusion_planner.backends.reference import execute_graph, execute_plan, random_inputs
from fusion_planner.core.examples import ew_chain, mlp_epilogue, mlp_stack
from fusion_planner.core.graph import GraphBuilder, GraphError, graph_from_json
from fusion_planner.core.ops import OPS
from fusion_planner.egraph.candidates import build_candidates
from fusion_planner.egraph.program import Limits


def _fanout_graph():
    """x -> relu -> (affine, silu) -> add: relu is read by two consumers."""
    b = GraphBuilder("fanout")
    b.input("x", (64,), "fp32")
    b.op("r", "Relu", ["x"])
    b.op("a", "Affine", ["r"], {"a": 2.0, "b": 1.0})
    b.op("s", "Silu", ["r"])
    b.op("o", "Add", ["a", "s"])
    return b.build(["o"])


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
        (lambda d: d["nodes"][0].pop("id"), "missing 'id'"),
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
        [sys.executable, "-m", "fusion_planner", *args], capture_output=True, text=True, cwd=cwd, timeout=120
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


def test_shared_store_written_once_and_register_value_recomputed():
    g = _fanout_graph()
    cands = build_candidates(g, "seed-k4")
    x = random_inputs(g, 3)
    ref = execute_graph(g, x)[0]
    for p in cands.plans:
        np.testing.assert_allclose(execute_plan(p, x)[0], ref, rtol=1e-5, atol=1e-6)
        outs = [k.out for k in p.kernels]
        assert len(outs) == len(set(outs)), "a stored tensor is written once"
    # the plan where both consumers recompute relu in their own kernels costs relu twice
    recompute = [
        p for p in cands.plans if sum("Relu" in k.ops for k in p.kernels) == 2 and all(k.out != "r" for k in p.kernels)
    ]
    assert recompute
    relu_flops = OPS["Relu"].flops((64,), [(64,)], {})
    p = recompute[0]
    assert p.flops == pytest.approx(2 * relu_flops + sum(OPS[o].flops((64,), [(64,)], {"a": 2, "b": 1}) for o in ("Affine", "Silu", "Add")))


def test_limits_hit_still_gives_a_valid_plan(caplog):
    g = ew_chain(6, 256)
    cands = build_candidates(g, "seed-k4", limits=Limits(max_iterations=1))
    assert cands.limit_hit and "iteration limit" in cands.limit_hit
    assert any("iteration limit" in n for n in cands.notes)
    x = random_inputs(g, 0)
    np.testing.assert_allclose(execute_plan(cands.best, x)[0], execute_graph(g, x)[0], rtol=1e-5)
    node_limited = build_candidates(g, "seed-k4", limits=Limits(max_nodes=5))
    assert node_limited.limit_hit and "node limit" in node_limited.limit_hit


def test_region_bound_limits_kernel_size():
    cands = build_candidates(ew_chain(8, 64), "seed-k4", limits=Limits(max_region_ops=3))
    assert max(max(p.partition) for p in cands.plans) == 3


def test_sampling_is_seeded_distinct_and_valid():
    g = mlp_stack(6, 16, 4, "fp32")
    cands = build_candidates(g, "h200", cap=50, k=10)
    assert not cands.complete and len(cands.plans) >= 10
    ex = cands.extractor
    a = [ex.key(c) for c in ex.sample(12, seed=7)]
    b = [ex.key(c) for c in ex.sample(12, seed=7)]
    c = [ex.key(c) for c in ex.sample(12, seed=8)]
    assert a == b and a != c and len(set(a)) == len(a) == 12
    x = random_inputs(g, 1)
    ref = execute_graph(g, x)[0]
    for choice in ex.sample(5, seed=1):
        np.testing.assert_allclose(execute_plan(ex.plan_of(choice), x)[0], ref, rtol=1e-4, atol=1e-4)
    # k-best plans are distinct and sorted
    keys = [p.key for p in cands.plans]
    assert len(keys) == len(set(keys))
    assert [p.sort_key() for p in cands.plans[:-1]] == sorted(p.sort_key() for p in cands.plans[:-1])


def test_dp_best_matches_exhaustive_on_small_space():
    g = mlp_stack(2, 16, 4, "fp16")
    full = build_candidates(g, "h200", cap=100_000)
    assert full.complete
    ex = full.extractor
    assert ex.cost(ex.dp_best()) == pytest.approx(full.best.est_us)


def test_ties_break_on_launches_then_registers():
    cands = build_candidates(mlp_epilogue(16, 4096, 4096), "seed-k4")
    tied = [p for p in cands.plans if p.launches == 2]
    regs = [p.reg_peak for p in tied if round(p.est_us, 6) == round(tied[0].est_us, 6)]
    assert regs == sorted(regs)


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
    from fusion_planner.cli import main

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
    from fusion_planner.cli import main

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

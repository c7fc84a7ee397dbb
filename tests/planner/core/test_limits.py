"""Input limits: defaults, environment variables and flags, the same for the CLI, the API and the runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.cupy.__main__ import main as runner_main
from backends.cupy.bundle import BundleError, export_bundle, load_bundle
from planner.cli import main
from planner.core import limits
from planner.core.cost import load_device
from planner.core.errors import UsageError
from planner.core.examples import ew_chain
from planner.core.graph import GraphBuilder, GraphError, load_graph
from planner.core.planfile import PlanFileError, content_hash, load_plan
from planner.egraph.candidates import build_candidates


def _graph_file(tmp_path: Path, n: int = 64, k: int = 2) -> Path:
    path = tmp_path / "g.json"
    path.write_text(ew_chain(k, n, "fp32").dumps())
    return path


def test_flags_override_the_environment_and_name_themselves(tmp_path, monkeypatch, capsys) -> None:
    g = str(_graph_file(tmp_path))
    cases = {
        "--max-elements": ("32", "elements exceeds the limit of 32"),
        "--max-rank": ("1", None),  # the chain is rank 1: it fits
        "--max-graph-nodes": ("3", "nodes exceed the limit of 3"),
        "--max-file-bytes": ("100", "larger than 100 bytes"),
    }
    for flag, (value, message) in cases.items():
        rc = main(["explain", "--graph", g, flag, value])
        err = capsys.readouterr().err
        if message is None:
            assert rc == 0, err
        else:
            assert rc == 2 and message in err and flag in err, (flag, err)
    monkeypatch.setenv("FUSION_PLANNER_MAX_ELEMENTS", "32")
    assert main(["explain", "--graph", g]) == 2
    assert "$FUSION_PLANNER_MAX_ELEMENTS" in capsys.readouterr().err
    assert main(["explain", "--graph", g, "--max-elements", "64"]) == 0  # the flag wins


def test_bad_limit_values_exit_2(tmp_path, monkeypatch, capsys) -> None:
    g = str(_graph_file(tmp_path))
    for bad in (["--max-rank", "0"], ["--max-depth", "x"]):
        with pytest.raises(SystemExit) as exc:  # refused by argparse
            main(["explain", "--graph", g, *bad])
        assert exc.value.code == 2
    monkeypatch.setenv("FUSION_PLANNER_MAX_RANK", "many")
    assert main(["explain", "--graph", g]) == 2
    assert "$FUSION_PLANNER_MAX_RANK must be a positive integer" in capsys.readouterr().err
    monkeypatch.delenv("FUSION_PLANNER_MAX_RANK")
    # a kernel of --max-region-ops ops must be readable back from its plan file
    assert main(["explain", "--graph", g, "--max-region-ops", "300"]) == 2
    assert "--max-depth" in capsys.readouterr().err
    assert main(["explain", "--graph", g, "--max-region-ops", "300", "--max-depth", "301"]) == 0


def test_the_api_holds_limits_for_a_block(tmp_path) -> None:
    path = _graph_file(tmp_path)
    with limits.input_limits(limits.InputLimits(elements=32)), pytest.raises(GraphError, match="limit of 32"):
        load_graph(path)
    assert load_graph(path).name  # the defaults are back after the block
    b = GraphBuilder("big")
    with limits.input_limits(limits.InputLimits(rank=2)), pytest.raises(GraphError, match="rank 3"):
        GraphBuilder("r").input("x", (2, 2, 2), "fp32")
    b.input("x", (2, 2, 2), "fp32")  # a builder made outside keeps the limits it was made with
    with pytest.raises(UsageError, match="positive integer"):
        limits.InputLimits(depth=0)


def _deep_body(depth: int) -> dict:
    body: dict = {"load": "x"}
    for i in range(depth):
        body = {"op": "Relu", "attrs": {}, "args": [body], "shape": [64], "dtype": "fp32", "node": f"r{i}"}
    return body


def test_deep_bodies_are_refused_by_their_limit_not_by_recursion(tmp_path) -> None:
    """A body past the depth limit is refused, in a plan file and in a bundle, with the flag named; under a
    larger limit the same body loads (it is structurally sound; running it would fail verification)."""
    plan_path = tmp_path / "plan.json"
    assert main(["plan", "--graph", str(_graph_file(tmp_path)), "--backend", "reference", "--out", str(tmp_path)]) == 0
    doc = json.loads(plan_path.read_text())
    doc["plan"]["kernels"][0]["body"] = _deep_body(300)
    doc["sha256"] = content_hash(doc)
    plan_path.write_text(json.dumps(doc))
    with pytest.raises(PlanFileError, match="nests deeper than 256 levels .--max-depth"):
        load_plan(plan_path)
    with limits.input_limits(limits.InputLimits(depth=400)):
        plan, _, _, _ = load_plan(plan_path)
    assert sum(1 for _ in plan.kernels[0].body.walk()) == 300
    bundle = export_bundle(build_candidates(ew_chain(2, 64, "fp32"), load_device("h200")))
    bundle["candidates"][0]["kernels"][0]["body"] = _deep_body(300)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(bundle))
    with pytest.raises(BundleError, match="nests deeper than 256"):
        load_bundle(path)


def test_the_runner_takes_the_same_limits(tmp_path, capsys) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps(export_bundle(build_candidates(ew_chain(2, 64, "fp32"), load_device("h200")))))
    out = str(tmp_path / "m.json")
    assert runner_main(["time", str(path), "-o", out, "--executor", "numpy", "--max-file-bytes", "1000"]) == 2
    assert "--max-file-bytes" in capsys.readouterr().err
    assert runner_main(["time", str(path), "-o", out, "--executor", "numpy", "--max-elements", "16"]) == 2
    assert "limit of 16" in capsys.readouterr().err
    assert runner_main(["time", str(path), "-o", out, "--executor", "numpy", "-q"]) == 0


def test_a_built_in_example_past_the_node_limit_stops_at_once(capsys) -> None:
    rc = main(["explain", "--example", "ew-chain", "--k", "99999999999", "--n", "64"])  # 2e11 nodes: never built
    assert rc == 2 and "more than 200,000 nodes (--max-graph-nodes" in capsys.readouterr().err
    assert main(["explain", "--example", "transformer", "--layers", "40", "--d-model", "64", "--seq", "8",
                 "--max-graph-nodes", "100"]) == 2
    with limits.input_limits(limits.InputLimits(graph_nodes=3)):
        b = GraphBuilder("tiny")
        b.input("x", (4,), "fp32")
        b.op("y", "Relu", ["x"])
        b.op("z", "Relu", ["y"])
        with pytest.raises(GraphError, match="more than 3 nodes"):
            b.op("w", "Relu", ["z"])


def test_a_file_limit_far_beyond_memory_reads_a_small_file(tmp_path) -> None:
    g = _graph_file(tmp_path)
    with limits.input_limits(limits.InputLimits(file_bytes=10**15)):  # f.read(limit + 1) would allocate a petabyte
        assert load_graph(g).name.startswith("ew-chain")
    with limits.input_limits(limits.InputLimits(file_bytes=5)), pytest.raises(GraphError, match="larger than 5 bytes"):
        load_graph(g)

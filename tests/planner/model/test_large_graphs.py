"""Graphs past the segment limit, through the CLI, and the long chains the limits must admit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _graphs import long_chain, write_graph

from planner.cli import main


@pytest.fixture(scope="module")
def chain300(tmp_path_factory):
    return str(write_graph(long_chain(300), tmp_path_factory.mktemp("g") / "chain300.json"))


def test_explain_past_the_segment_limit_shows_the_composite_and_says_why(chain300, capsys):
    assert main(["explain", "--graph", chain300, "--max-segment-ops", "64"]) == 0
    out = capsys.readouterr().out
    assert "300 ops in" in out and "note: 300 ops exceed the segment limit (max_segment_ops=64" in out
    rows = [line for line in out.splitlines() if line.startswith(("*", "   ["))]
    assert len(rows) == 2 and rows[0].startswith("*")
    assert main(["explain", "--graph", chain300, "--max-segment-ops", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [c["best"] for c in data["candidates"]] == [True, False] and data["notes"]
    assert data["candidates"][1]["kernels"] and len(data["candidates"][1]["kernels"]) == 300


def test_plan_past_the_segment_limit_says_why(chain300, capsys):
    assert main(["plan", "--graph", chain300, "--max-segment-ops", "64", "--backend", "reference", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "note: 300 ops exceed the segment limit" in out and "composite:" in out


def test_export_refuses_a_graph_past_the_segment_limit(chain300, tmp_path, capsys):
    assert main(["export-candidates", "--graph", chain300, "--max-segment-ops", "64", "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "--max-segment-ops 64" in err and "Traceback" not in err


#: the child's own peak: VmHWM of its memory map (getrusage's ru_maxrss keeps, across the exec, the high-water
#: mark of the pytest process that spawned it, which a long suite grows past 1 GB by itself)
PEAK = """
import resource, sys
from planner.cli import main
rc = main(sys.argv[1:])
try:
    peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("peak_kb", peak, file=sys.stderr)
sys.exit(rc)
"""


def _plan_in_child(graph: str) -> tuple[dict, int]:
    """``plan --graph`` with every default, in its own process: (its JSON report, its peak RSS in KiB)."""
    done = subprocess.run([sys.executable, "-c", PEAK, "plan", "--graph", graph, "--no-cache", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    peak = int(done.stderr.rsplit("peak_kb", 1)[1].split()[0])
    return json.loads(done.stdout), peak


def test_a_100k_node_chain_plans_with_the_default_limits_in_under_1_gb(tmp_path):
    graph = write_graph(long_chain(100_000, period=3), tmp_path / "chain100k.json")
    report, peak_kb = _plan_in_child(str(graph))
    assert report["ops"] == 100_000 and report["notes"] and report["regions"] >= 98
    assert 100_000 / 64 <= report["kernels"] < 100_000 / 32  # fused, every kernel within the region cap
    assert peak_kb < 1024 * 1024, f"peak RSS {peak_kb / 1024:.0f} MiB"


def test_a_10k_node_chain_of_distinct_segments_plans_in_under_1_gb(tmp_path):
    graph = write_graph(long_chain(10_000), tmp_path / "chain10k.json")
    report, peak_kb = _plan_in_child(str(graph))
    assert report["ops"] == 10_000 and report["unique_regions"] == report["regions"] >= 10
    assert peak_kb < 1024 * 1024, f"peak RSS {peak_kb / 1024:.0f} MiB"


def test_a_wide_fan_out_of_distinct_outputs_plans(tmp_path, capsys):
    """1,000 outputs in one segment: the exact enumeration recursed once per output (RecursionError)."""
    from planner.core.graph import GraphBuilder

    b = GraphBuilder("fan")
    x = b.input("x", (8,), "fp32")
    outs = [b.op(f"o{i}", "Affine", [x], {"a": 1.0 + i * 1e-3, "b": 0.0}) for i in range(1000)]
    graph = str(write_graph(b.build(outs), tmp_path / "fan.json"))
    assert main(["explain", "--graph", graph, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["enumerated"] and len(data["candidates"][0]["kernels"]) == 1000


def test_explain_json_of_a_plan_space_past_4300_digits(capsys):
    """A 4-layer transformer has ~10^15,285 plans: Python refuses to print an int that long, so the JSON
    carries the count as ``~9.5e15284`` text and ``space_log10`` (it crashed in json.dumps)."""
    assert main(["explain", "--example", "transformer", "--layers", "4", "--d-model", "64", "--seq", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data["space"], str) and data["space"].startswith("~") and data["space_log10"] > 4300
    assert data["candidates"] and any(c["best"] for c in data["candidates"])

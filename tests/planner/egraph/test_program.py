"""Loading a graph into egglog stays linear in the graph (egglog's cost for one long program is not)."""

import json
import subprocess
import sys

import pytest

from planner.cli import main
from planner.core.examples import ew_chain
from planner.core.graph import Graph, GraphBuilder
from planner.egraph import program
from planner.egraph.program import PROGRAM_CHUNK, Limits, graph_commands, saturate
from planner.rules.load import load_rules

PROBE = """
import json, resource
from planner.core.examples import ew_chain
from planner.egraph.program import Limits, saturate
from planner.rules.load import load_rules
rules = load_rules()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sat = saturate(ew_chain(1000, 64), rules, Limits())
print(json.dumps({"grown_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
                  "enodes": sat.enodes, "build_s": sat.build_s}))
"""


def test_a_1500_node_chain_loads_in_bounded_memory():
    """One 1,500-line program took egglog 0.95 GB and its memory grew with the square of the length (a
    10,000-node chain was killed at 24 GB); loaded in runs of PROGRAM_CHUNK lines it takes a few MB."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["enodes"] > 3000
    assert probe["grown_mb"] < 300, probe


def test_the_commands_are_one_let_per_node_then_the_outputs():
    g = ew_chain(3, 16)
    lines = graph_commands(g)
    assert len(lines) == len(g.nodes) + 1 and all(line.startswith("(let $n") for line in lines[:-1])
    assert lines[-1].startswith("(rule ((= m $n") and "Forced" in lines[-1]
    assert PROGRAM_CHUNK <= 256


ASSOC = """(ruleset assoc)
; a stress case: Add is commutative and associative (in exact arithmetic)
(rewrite (Add a b) (Add b a) :ruleset assoc)
(rewrite (Add (Add a b) c) (Add a (Add b c)) :ruleset assoc)
"""


def _sum16() -> Graph:
    b = GraphBuilder("sum16")
    y = b.input("x0", (16,), "fp32")
    for i in range(1, 16):
        y = b.op(f"s{i}", "Add", [y, b.input(f"x{i}", (16,), "fp32")])
    return b.build([y])


@pytest.mark.parametrize("max_nodes", [2_000, 20_000, 500_000])
def test_associativity_stops_within_the_node_limit_inside_an_iteration(max_nodes, tmp_path, monkeypatch):
    """One iteration applied every match at once: the 16-term sum grew 5.5x past 500,000 e-nodes (2.7 M,
    5.7 GB) before the limit was checked; now no rule applies more matches than the budget left holds."""
    rule_file = tmp_path / "assoc.egg"
    rule_file.write_text(ASSOC)
    sizes: list[int] = []
    real = program._size
    monkeypatch.setattr(program, "_size", lambda eg: sizes.append(real(eg)) or sizes[-1])
    sat = saturate(_sum16(), load_rules([str(rule_file)]), Limits(max_nodes=max_nodes))
    assert sat.limit_hit and sat.limit_hit.startswith(f"node limit ({max_nodes}) in stage user")
    assert max(sizes) <= program.NODE_OVERSHOOT * max_nodes


def test_a_plan_under_an_exploding_rule_is_still_valid(tmp_path, capsys):
    rule_file = tmp_path / "assoc.egg"
    rule_file.write_text(ASSOC)
    graph = tmp_path / "sum16.json"
    graph.write_text(json.dumps(_sum16().to_json()))
    args = ["plan", "--graph", str(graph), "--rules", str(rule_file), "--backend", "reference", "--no-cache",
            "--max-nodes", "20000"]
    assert main(args) == 0
    assert "every candidate shown passed verification" in capsys.readouterr().out

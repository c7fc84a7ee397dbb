"""Loading a graph into egglog stays linear in the graph (egglog's cost for one long program is not)."""

import json
import subprocess
import sys

from fusion_planner.core.examples import ew_chain
from fusion_planner.egraph.program import PROGRAM_CHUNK, graph_commands

PROBE = """
import json, resource
from fusion_planner.core.examples import ew_chain
from fusion_planner.egraph.program import Limits, saturate
from fusion_planner.rules.load import load_rules
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

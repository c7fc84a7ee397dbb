"""Identical nodes are hash-consed by egglog into one e-class; planning must still work."""

from backends.reference import execute_graph, execute_plan, random_inputs
from planner.candidates import build_candidates
from planner.graph import GraphBuilder
from planner.tolerance import allclose_report


def test_two_identical_nodes_share_a_class_and_both_outputs_are_planned():
    b = GraphBuilder("cse")
    b.input("x", (3, 5), "fp16")
    b.op("n0", "Relu", ["x"])
    b.op("n1", "Relu", ["x"])  # the same term as n0: egglog's class_data lists "$n1, $n2"
    b.op("n2", "Silu", ["n1"])
    graph = b.build(["n0", "n2"])
    cands = build_candidates(graph, "seed-k4")
    inputs = random_inputs(graph, seed=1)
    want = execute_graph(graph, inputs)
    for plan in cands.plans:
        got = execute_plan(plan, inputs)
        assert len(got) == 2
        for g, w in zip(got, want, strict=True):
            assert allclose_report(g, w, "fp16")[0], plan.notation()

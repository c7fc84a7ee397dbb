"""Identical nodes are hash-consed by egglog into one e-class; planning must still work."""

from testpaths import FIXTURES

from planner.core.cost import load_device
from planner.core.graph import GraphBuilder
from planner.core.reference import execute_graph, execute_plan, random_inputs
from planner.core.tolerance import allclose_report
from planner.egraph.candidates import build_candidates


def test_two_identical_nodes_share_a_class_and_both_outputs_are_planned():
    b = GraphBuilder("cse")
    b.input("x", (3, 5), "fp16")
    b.op("n0", "Relu", ["x"])
    b.op("n1", "Relu", ["x"])  # the same term as n0: egglog's class_data lists "$n1, $n2"
    b.op("n2", "Silu", ["n1"])
    graph = b.build(["n0", "n2"])
    cands = build_candidates(graph, load_device("seed-k4"))
    inputs = random_inputs(graph, seed=1)
    want = execute_graph(graph, inputs)
    for plan in cands.plans:
        got = execute_plan(plan, inputs)
        assert len(got) == 2
        for g, w in zip(got, want, strict=True):
            assert allclose_report(g, w, "fp16")[0], plan.notation()


def test_values_a_user_rule_creates_are_typed_and_planned():

    from planner.rules.load import load_rules

    b = GraphBuilder("dist")
    for name in ("x", "y", "z"):
        b.input(name, (3, 7), "bf16")
    b.op("a", "Add", ["y", "z"])
    b.op("m", "Mul", ["x", "a"])
    graph = b.build(["m"])
    rules = load_rules([FIXTURES / "good_rules" / "distribute.egg"])
    cands = build_candidates(graph, load_device("seed-k4"), rules=rules)
    assert any(k.ops.count("Mul") == 2 for p in cands.plans for k in p.kernels)  # the rule's form is a candidate
    inputs = random_inputs(graph, seed=3)
    (want,) = execute_graph(graph, inputs)
    for plan in cands.plans:
        (got,) = execute_plan(plan, inputs)
        assert allclose_report(got, want, "bf16")[0], plan.notation()

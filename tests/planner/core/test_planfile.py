"""Plans written to JSON (plan files, the plan cache, GPU bundles) come back as the kernels they were."""

import dataclasses

from backends.cpu.codegen import generate
from planner.core.cost import load_device
from planner.core.examples import layer_norm
from planner.core.planfile import plan_document, plan_from_document
from planner.core.plans import expr_from_json, expr_to_json
from planner.egraph.candidates import build_candidates


def test_a_value_two_consumers_share_comes_back_shared_and_is_computed_once():
    """LayerNorm's row mean feeds the centring of both the variance and the output: written as a tree, read
    back as one object, so the generated row kernel reduces the row for it once, as before the round trip."""
    graph = layer_norm(8, 64, "fp32", residual=False)
    cands = build_candidates(graph, load_device("h200"))
    plan = next(p for p in cands.plans if len(p.kernels) == 1)
    (kernel,) = plan.kernels
    body = expr_from_json(expr_to_json(kernel.body))
    assert body == kernel.body
    assert len(list(body.walk())) == len(list(kernel.body.walk()))
    means = {id(e) for e in body.walk() if e.node == "mean"}
    assert len(means) == 1
    back, _, _, _ = plan_from_document(plan_document(plan, graph, cands.spec))
    types = {n: (tuple(t.shape), t.dtype) for n, t in plan.tensors.items()}
    assert generate(back.kernels[0].body, types).source == generate(kernel.body, types).source
    assert dataclasses.replace(back.kernels[0], cost=kernel.cost).body == kernel.body

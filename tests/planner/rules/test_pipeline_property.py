"""Whole-pipeline property: every plan the planner extracts computes what the unfused plan computes.

Hypothesis builds random op graphs (chains and DAGs with fan-out and residuals, every op of the op table a kernel
computes in registers, drawn from the table, with MatMul and Opaque norms, and Casts between dtypes) with
small odd shapes and fp16/bf16/fp32, plans them with the shipped rules and runs every candidate (or
a bounded sample) on the numpy reference.  A failure prints the graph JSON.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _fuzz import graphs
from hypothesis import HealthCheck, Phase, assume, event, given, note, settings
from hypothesis import strategies as st
from testpaths import FIXTURES

from planner.core.cost import load_device
from planner.core.graph import graph_from_json
from planner.core.reference import execute_graph, execute_plan, random_inputs
from planner.core.tolerance import check_outputs
from planner.egraph.candidates import build_candidates
from planner.rules.files import RuleFile, shipped_rules
from planner.rules.load import user_rules

MAX_PLANS = 24  # executed per graph (all when there are fewer)


# derandomized, as the other fuzz tests: the same 500 graphs on every run, so CI's verdict is the code's, not the
# draw's; a random run found the case below, which stays as a known failure until it is fixed
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          derandomize=True, database=None)
@given(graph=graphs(), seed=st.integers(0, 3))
def test_every_candidate_agrees_with_the_unfused_plan(graph: dict, seed: int) -> None:
    check_candidates(graph, seed)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="known: fp16 value stored rounded by one kernel and recomputed unrounded by "
                   "another; the difference survives a cancellation (the search rejects such a plan on its output check)")
def test_a_stored_and_a_recomputed_copy_of_one_fp16_value_agree() -> None:
    """Found by a random run of the property above: n1 = n0 + n0 is stored in fp16 by one kernel, while the next
    recomputes n0 in fp32 and takes n0 - (relu(n1) - n0), which is 0 on the unrounded and on the unfused values
    but twice n0's rounding error on the mix: 0.0084 against outputs of about 0.2."""
    found = json.loads((FIXTURES / "fp16_recompute_cancellation.json").read_text())

    @settings(max_examples=1, database=None, phases=[Phase.generate])
    @given(graph=st.just(found), seed=st.just(3))
    def found_case(graph: dict, seed: int) -> None:
        check_candidates(graph, seed)

    found_case()


def check_candidates(graph_json: dict, seed: int, rules: list[RuleFile] | None = None) -> None:
    note(f"graph JSON:\n{json.dumps(graph_json, indent=1)}")
    graph = graph_from_json(graph_json)
    cands = build_candidates(graph, load_device("seed-k4"), rules=rules, cap=64, k=8, seed=seed)
    inputs = random_inputs(graph, seed=seed)
    unfused = cands.unfused
    want = execute_plan(unfused, inputs)
    for name, w, r in zip(graph.outputs, want, execute_graph(graph, inputs), strict=True):
        assert np.array_equal(w, r, equal_nan=True), f"the unfused plan is not the graph at output {name!r}"
    # a graph that overflows its dtype (exp of exp in fp16) has no finite reference to compare with: the output
    # check refuses to verify against one, so such a draw proves nothing either way
    assume(all(bool(np.isfinite(w).all()) for w in want))
    plans = cands.plans
    if len(plans) > MAX_PLANS:
        rng = np.random.default_rng(seed)
        keep = set(rng.choice(len(plans), MAX_PLANS, replace=False).tolist()) | {0}
        plans = [p for i, p in enumerate(plans) if i in keep]
    event(f"candidates: {'1' if len(cands.plans) == 1 else '2-8' if len(cands.plans) <= 8 else '9+'}")
    for kind in sorted({k.label for p in plans for k in p.kernels}):
        event(f"kernel {kind}")
    exact = execute_graph(graph, inputs, mode="oracle")
    for plan in plans:
        # the project's one output check, with its fp64-oracle allowance: an ill-conditioned graph (a norm
        # over near-equal values) amplifies the rounding a fusion moves
        reason, _, _ = check_outputs(plan, execute_plan(plan, inputs), want, oracle=exact)
        assert reason is None, f"plan {plan.notation()} ({plan.composition()}) differs from the unfused plan: {reason}"


def test_the_property_catches_an_unsound_rule_and_prints_a_small_graph():
    # the planner refuses this file; load it unchecked to prove the property can fail
    bad = FIXTURES / "bad_rules" / "drops_term.egg"
    rules = shipped_rules() + user_rules([bad], check=False)

    @settings(
        max_examples=500,
        deadline=None,
        database=None,
        derandomize=True,
        report_multiple_bugs=False,
        phases=[Phase.generate, Phase.shrink],
    )
    @given(graph=graphs(), seed=st.integers(0, 3))
    def prop(graph: dict, seed: int) -> None:
        check_candidates(graph, seed, rules)

    # a candidate (or the unfused plan) differs, or the extractor trips over the classes the
    # unsound union merged; either way the shrunk graph is printed
    with pytest.raises(Exception) as info:  # noqa: B017
        prop()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    shown = json.loads(notes[notes.index("graph JSON:") + len("graph JSON:") : notes.rindex("}") + 1])
    assert [n["op"] for n in shown["nodes"]].count("Add") >= 2
    assert len(shown["nodes"]) <= 10, notes  # shrunk to a handful of nodes (a bias vector is a node of its own)

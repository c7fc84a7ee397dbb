"""A region's search as a job: its parts, the final comparison of their bests, the budget's shares."""

from __future__ import annotations

import time

import pytest

from planner.cluster.jobs import Budget, Parts, RegionJob, search_region, work
from planner.core import examples
from planner.core.cost import load_device
from planner.core.regions import split_regions, whole_graph_region
from planner.registry import get_backend
from planner.rules.load import load_rules
from planner.search.results import SearchOptions
from planner.search.searchlog import SearchLog

SPEC = load_device("h200")
GRAPH = examples.ew_chain(6, 4096)


def job(**options) -> RegionJob:
    region = whole_graph_region(GRAPH)
    return RegionJob(region, "chain", SPEC, tuple(load_rules()), None, 4096, 16,
                     SearchOptions(**{"max_candidates": 16, **options}))


def run(j: RegionJob, worker: str):
    outcome = search_region(j, get_backend("model", SPEC), SearchLog(enabled=False))
    outcome.worker = worker
    return outcome


def test_parts_share_the_candidates_and_the_final_compares_their_bests():
    parts = Parts()
    first, second = parts.split(job(), 2)
    assert (first.stage, second.stage) == ("part 1/2", "part 2/2")
    a, b = run(first, "w1"), run(second, "w2")
    assert parts.after(a) == (None, [])
    done, due = parts.after(b)
    assert done is None and len(due) == 1 and due[0].stage == "final"
    assert {p.key for p in due[0].finalists} == {a.result.best.key, b.result.best.key}
    keys_a = {e.plan.key for e in a.result.entries if e.timed and e.source == "model order"}
    keys_b = {e.plan.key for e in b.result.entries if e.timed and e.source == "model order"}
    assert keys_a and keys_b and not keys_a & keys_b  # every other candidate of the cost model's list each
    final = run(due[0], "w1")
    region, more = parts.after(final)
    assert more == [] and region is not None and region.worker == "w1,w2"
    assert region.result.best.key == min((a.result.best, b.result.best), key=lambda p: p.est_us).key
    assert [line[:4] for line in region.result.log_lines if "] Search " in line] == ["[w1]", "[w2]", "[w1]"]
    assert keys_a | keys_b <= {e.plan.key for e in region.result.entries}  # no part's candidate lost


def test_a_whole_job_passes_through_with_its_worker_named():
    parts = Parts()
    (only,) = parts.split(job(), 1)
    outcome = run(only, "w3")
    done, due = parts.after(outcome)
    assert done is outcome and due == [] and done.result.log_lines[0].startswith("[w3] Search ")


def test_the_budget_shares_what_is_left_between_the_regions_still_to_search():
    budget = Budget(10.0, 4)
    assert budget.share() == pytest.approx(2.5, rel=0.05)
    assert budget.share(at_once=2) == pytest.approx(5.0, rel=0.05)  # two searched side by side
    budget.done()
    budget.done()
    budget.done()
    assert budget.share(at_once=4) == pytest.approx(10.0, rel=0.05)  # one left: never more than what is left
    budget.deadline = time.perf_counter() - 1
    assert budget.share() == pytest.approx(1e-3)


def test_the_largest_region_is_sent_first():
    regions = split_regions(examples.transformer(1, 64, 16, "fp32"))
    biggest = max(regions, key=work)
    assert any(n.op == "MatMul" for n in biggest.graph.ops)
    assert work(biggest) > 10 * min(work(r) for r in regions)

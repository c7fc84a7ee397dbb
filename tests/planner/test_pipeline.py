"""One pipeline: the Python API, the CLI and torch.compile plan alike and share the plan cache."""

from __future__ import annotations

import contextlib
import logging

import pytest
from _fake_backend import TimedReferenceBackend
from testpaths import ROOT

from planner.cli import main
from planner.core import examples
from planner.core.cost import load_device
from planner.pipeline import PlanOptions, plan_graph
from planner.rules.load import load_rules
from planner.search.results import SearchOptions
from planner.search.searchlog import SearchLog

torch = pytest.importorskip("torch")

FACTORY = f"{ROOT / 'examples' / 'mlp.py'}:build"
#: the options torch.compile uses by default, given to every entry point
OPTIONS = {"max_candidates": 16, "time_budget_s": 10.0}


def test_api_cli_and_torch_compile_share_one_plan_and_one_cache_key(capsys, caplog):
    import planner
    from planner.torch.importer import load_factory

    module, (x,) = load_factory(FACTORY)
    with caplog.at_level(logging.WARNING):
        first = planner.plan(module, (x,), backend="model", **OPTIONS)
        assert first.planned is not None and not first.planned.from_cache and first.planned.cache_key

        again = planner.plan(module, (x,), backend="model", **OPTIONS)
        assert again.planned.from_cache and again.planned.cache_key == first.planned.cache_key
        assert again.plan.key == first.plan.key

        torch._dynamo.reset()
        compiled = torch.compile(module, backend="fusion_planner", options={"backend": "model"})
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), module(x), rtol=1e-4, atol=1e-4)
        torch._dynamo.reset()

        assert main(["plan", "--torch", FACTORY, "--backend", "model", "--max-candidates", "16",
                     "--time-budget", "10"]) == 0
    assert "plan from the cache" in capsys.readouterr().out  # the CLI hit the API's entry: the same key
    assert "corrupt or stale" not in caplog.text  # no entry point evicted another's entry


def test_dynamo_plans_through_the_pipeline_with_the_same_key(monkeypatch):
    """torch.compile's captured graph (another name, other node ids) lands on the API's cache key."""
    import planner
    import planner.api
    from planner.torch.importer import load_factory

    module, (x,) = load_factory(FACTORY)
    keys = []
    real = planner.api.plan_graph

    def spy(graph, options, backend, **kw):
        planned = real(graph, options, backend, **kw)
        keys.append((graph.name, planned.cache_key, planned.plan.key, planned.from_cache))
        return planned

    monkeypatch.setattr(planner.api, "plan_graph", spy)
    planner.plan(module, (x,), backend="model", **OPTIONS)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend="fusion_planner", options={"backend": "model"})(x)
    torch._dynamo.reset()
    (api_name, api_key, api_plan, _), (dyn_name, dyn_key, dyn_plan, dyn_cached) = keys
    assert api_name != dyn_name and api_key == dyn_key and api_plan == dyn_plan and dyn_cached


def test_a_plan_made_under_other_limits_is_not_served_from_the_cache():
    """The kernel-size bound (and every other limit) is part of the cache key: a plan chosen under
    ``max_region_ops=3`` cannot answer a planner allowed bigger kernels."""
    import planner
    from planner.core.examples import ew_chain
    from planner.egraph.program import Limits

    g = ew_chain(4, 256)
    small = planner.plan(g, backend="model", limits=Limits(max_region_ops=3), **OPTIONS)
    assert max(len(k.ops) for k in small.plan.kernels) <= 3
    again = planner.plan(g, backend="model", limits=Limits(max_region_ops=3), **OPTIONS)
    assert again.planned.from_cache and again.planned.cache_key == small.planned.cache_key
    big = planner.plan(g, backend="model", **OPTIONS)
    assert big.planned.cache_key != small.planned.cache_key and not big.planned.from_cache
    assert len(big.plan.kernels) == 1


def test_each_search_names_what_it_searches_and_counts_against_a_known_total():
    """The progress a face shows: one per search, labelled with the graph or 'region i/n <title>', ticking from
    (0, total) with the total known before the first candidate."""
    seen: list[tuple[str, list[tuple[int, int]]]] = []

    @contextlib.contextmanager
    def progress(label: str):
        ticks: list[tuple[int, int]] = []
        seen.append((label, ticks))
        yield SearchLog(), lambda done, total: ticks.append((done, total))

    spec = load_device("h200")
    options = PlanOptions("reference", spec, tuple(load_rules(())), search=SearchOptions(max_candidates=3))
    backend = TimedReferenceBackend(spec)
    plan_graph(examples.ew_chain(3, 256, "fp32"), options, backend, cache=None, progress=progress)
    plan_graph(examples.mlp_stack(2, 16, 8, "fp32"), options, backend, cache=None, progress=progress)
    (whole, ticks), (region, region_ticks) = seen
    assert whole == "ew-chain-k3-256-fp32" and ticks[0] == (0, 3) and ticks[-1] == (3, 3)
    assert region.startswith("region 1/1 gemm 8x16 #") and region_ticks[0][0] == 0


def test_ops_no_output_depends_on_are_left_out_of_the_plan(caplog):
    """What a module computes and its result leaves unused (CLIP's pooled output beside the hidden states the
    caller returns): not planned, said once; a graph of only such ops at its end planned before as a region
    with no outputs and failed."""
    import planner
    from planner.core.graph import GraphBuilder

    b = GraphBuilder("dead-tail")
    b.input("x", (8, 16), "fp32")
    y = b.op("y", "Relu", ["x"])
    b.op("unused_middle", "Exp", ["x"])
    b.op("unused_tail", "Affine", [b.op("unused_tail_in", "Sigmoid", [y])], {"a": 2.0, "b": 0.0})
    g = b.build([y])
    live = g.live()
    assert [n.id for n in live.nodes] == ["x", "y"] and live.outputs == ("y",) and live.live() is live
    with caplog.at_level(logging.INFO, logger="planner.pipeline"):
        result = planner.plan(g, backend="cpu", **OPTIONS)
    assert [k.out for k in result.plan.kernels] == ["y"]
    assert "3 op(s) compute values no output depends on" in caplog.text


@pytest.mark.parametrize(("call_us", "runs"), [(100_000.0, 3), (60_000.0, 4), (1_000.0, 7)])
def test_a_composite_plan_is_timed_in_as_many_runs_as_fit_its_reporting_time(call_us: float, runs: int) -> None:
    """A layer stack's composite and unfused plans are timed for the report only: one warm-up, then at least three
    runs and more, up to the search's repeats, while they fit ``COMPOSITE_TIMING_S``."""
    from planner import pipeline
    from planner.backend import collect_samples

    class Steady:
        def time(self, inputs, *, warmup, repeats, stop_if=None):  # noqa: ANN001, ANN202
            self.warmup, self.timing = warmup, collect_samples(lambda: call_us, warmup=warmup, repeats=repeats,
                                                               stop_if=stop_if)
            return self.timing

    steady = Steady()
    assert pipeline.COMPOSITE_TIMING_S == 0.2
    assert pipeline._reported_us(steady, {}, SearchOptions()) == call_us  # type: ignore[arg-type]
    assert len(steady.timing.samples_us) == runs and steady.warmup == 1

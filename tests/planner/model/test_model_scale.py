"""Whole-model planning: region dedup, layer-by-layer equality, the plan cache."""

import json

import numpy as np
import pytest
from _graphs import long_chain
from testpaths import ROOT

from planner.cli import main
from planner.core.cost import load_device
from planner.core.examples import ew_chain, mlp_epilogue, mlp_stack, transformer
from planner.core.reference import execute_graph, execute_plan, random_inputs
from planner.core.regions import split_regions
from planner.egraph.program import Limits
from planner.model.plancache import PlanCache
from planner.model.stack import plan_model


def test_regions_find_repeated_layers_without_markers():
    g4 = transformer(4, 64, 8)
    regions = split_regions(g4)
    assert len({r.key for r in regions}) == 6  # layer 0 is cut in 4 pieces (x is a graph input), the others in 2
    g8 = transformer(8, 64, 8)
    assert {r.key for r in split_regions(g8)} == {r.key for r in regions}


def test_small_chains_stay_one_region():
    # no forced store inside: cutting would lose fusion, so the seed examples are one region
    for g in (ew_chain(8, 64), mlp_epilogue(8, 8, 8)):
        assert len(split_regions(g)) == 1


def test_four_layer_plan_equals_one_layer_plan_layer_by_layer():
    one = plan_model(mlp_stack(1, 32, 4), load_device("h200"))
    four = plan_model(mlp_stack(4, 32, 4), load_device("h200"))
    per_layer = len(one.plan.kernels)
    assert len(four.plan.kernels) == 4 * per_layer
    shape = [(k.kind, k.epilogue, k.ops) for k in one.plan.kernels]
    for i in range(4):
        chunk = four.plan.kernels[i * per_layer : (i + 1) * per_layer]
        assert [(k.kind, k.epilogue, k.ops) for k in chunk] == shape
        assert chunk[-1].out == f"res{i}"
    assert four.plan.est_us == pytest.approx(4 * one.plan.est_us)
    assert len(four.unique) == 1 and four.unique[next(iter(four.unique))].instances == 4


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_four_layer_transformer_plan_equals_one_layer_plan(mlp):
    one = plan_model(transformer(1, 32, 8, "fp32", mlp), load_device("h200"))
    four = plan_model(transformer(4, 32, 8, "fp32", mlp), load_device("h200"))
    n = len(one.plan.kernels)
    assert len(four.plan.kernels) == 4 * n
    shape = [(k.kind, k.epilogue, k.ops) for k in one.plan.kernels]
    for i in range(4):
        chunk = four.plan.kernels[i * n : (i + 1) * n]
        assert [(k.kind, k.epilogue, k.ops) for k in chunk] == shape
        assert {k.out.split(".")[0] for k in chunk} == {f"l{i}"}
    assert four.plan.est_us == pytest.approx(4 * one.plan.est_us)


def test_limits_hit_in_a_region_is_logged_and_the_plan_stays_valid(caplog):
    g = transformer(2, 32, 8, "fp32")
    mp = plan_model(g, load_device("h200"), limits=Limits(max_iterations=1))
    assert "saturation stopped early: iteration limit (1)" in caplog.text
    x = random_inputs(g, 1)
    np.testing.assert_allclose(execute_plan(mp.plan, x)[0], execute_graph(g, x)[0], rtol=1e-4, atol=1e-4)
    full = plan_model(g, load_device("h200"))
    assert mp.plan.est_us >= full.plan.est_us  # fewer rewrites: never a better plan than the full search


@pytest.mark.parametrize("graph", [mlp_stack(4, 16, 4, "fp32"), transformer(3, 32, 8, "fp32", "swiglu")])
def test_composite_plan_executes_like_the_unfused_graph(graph):
    mp = plan_model(graph, load_device("h200"))
    x = random_inputs(graph, 2)
    ref = execute_graph(graph, x)[0]
    np.testing.assert_allclose(execute_plan(mp.plan, x)[0], ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(execute_plan(mp.unfused, x)[0], ref, rtol=1e-6, atol=1e-6)
    assert len(mp.unfused.kernels) == len(graph.ops)
    assert len({k.out for k in mp.plan.kernels}) == len(mp.plan.kernels)


def test_cache_hit_and_corrupt_entry_rebuilt(tmp_path, caplog):
    g = mlp_stack(3, 16, 4)
    cache = PlanCache(tmp_path)
    first = plan_model(g, load_device("h200"), cache=cache)
    assert first.cache_hits == 0
    second = plan_model(g, load_device("h200"), cache=cache)
    assert second.cache_hits == 1 and second.plan.key == first.plan.key
    # tamper with the entry: a changed kernel kind breaks the checksum
    (entry,) = tmp_path.glob("*.json")
    data = json.loads(entry.read_text())
    data["plan"]["kernels"][0]["kind"] = "elementwise"  # sha256 no longer matches
    entry.write_text(json.dumps(data))
    third = plan_model(g, load_device("h200"), cache=cache)
    assert third.cache_hits == 0 and cache.rebuilt
    assert "corrupt or stale" in caplog.text
    assert third.plan.key == first.plan.key
    entry.write_text("{truncated")
    assert plan_model(g, load_device("h200"), cache=cache).cache_hits == 0
    assert plan_model(g, load_device("h200"), cache=cache).cache_hits == 1
    # another device spec is another key
    assert plan_model(g, load_device("seed-k4"), cache=cache).cache_hits == 0


def test_cache_clear_cli(tmp_path, capsys):
    plan_model(mlp_stack(2, 16, 4), load_device("h200"), cache=PlanCache(tmp_path))
    assert list(tmp_path.glob("*.json"))
    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert not tmp_path.exists() or not list(tmp_path.glob("*.json"))


def test_dedup_off_plans_the_whole_graph():
    g = mlp_stack(2, 16, 4)
    mp = plan_model(g, load_device("h200"), dedup=False)
    assert not mp.dedup and len(mp.regions) == 1
    x = random_inputs(g, 0)
    np.testing.assert_allclose(execute_plan(mp.plan, x)[0], execute_graph(g, x)[0], rtol=1e-2, atol=1e-2)


def test_plan_cli_searches_each_region_once_and_caches(tmp_path, capsys):
    args = ["plan", "--example", "transformer", "--layers", "3", "--d-model", "32", "--seq", "8", "--dtype", "fp32",
            "--backend", "reference", "--cache-dir", str(tmp_path)]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "in 9 regions, 6 unique (0 from the cache)" in first
    assert "verified against the reference" in first
    assert main(args) == 0
    assert "6 unique (6 from the cache)" in capsys.readouterr().out
    assert main([*args, "--no-cache"]) == 0
    assert "(0 from the cache)" in capsys.readouterr().out


def test_plan_cli_single_region_cache(tmp_path, capsys):
    args = ["plan", "--example", "mlp-epilogue", "--m", "8", "--n", "8", "--k", "8", "--cache-dir", str(tmp_path)]
    assert main(args) == 0
    assert "from the cache" not in capsys.readouterr().out
    assert main(args) == 0
    assert "plan from the cache, not re-searched" in capsys.readouterr().out


def test_torch_defined_stack_dedups_and_matches_eager():
    torch = pytest.importorskip("torch")
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    from transformer_block import Block

    import planner
    from planner.torch.importer import import_module

    torch.manual_seed(0)
    keys = []
    for layers in (2, 4):
        stack = torch.nn.Sequential(*[Block(32, 4, 64) for _ in range(layers)]).eval()
        x = torch.randn(1, 8, 32)
        regions = split_regions(import_module(stack, (x,)).graph)
        keys.append({r.key for r in regions})
        assert len(regions) > len(keys[-1])  # layers repeat without any layer markers
    assert keys[0] == keys[1]
    result = planner.plan(stack, (x,), backend="reference")
    assert result.model_plan is not None and len(result.model_plan.unique) == len(keys[1])
    with torch.no_grad():
        expected = stack(x)
    torch.testing.assert_close(result(x), expected, rtol=1e-4, atol=1e-4)
    region_rows = [line for line in result.table().splitlines() if line.startswith("region ")]
    assert len(region_rows) == len(result.model_plan.unique)


def test_plan_cli_composite_mismatch_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    import planner.pipeline

    real = planner.pipeline.check_outputs
    name = "transformer-L2-d32-s8-fp32-gelu"  # region searches check plans of "<name>.rN": only the composite fails

    def planted(plan, *args, **kw):
        return ("tolerance: planted for this test", 1.0, 1.0) if plan.graph == name else real(plan, *args, **kw)

    monkeypatch.setattr(planner.pipeline, "check_outputs", planted)
    args = ["plan", "--example", "transformer", "--layers", "2", "--d-model", "32", "--seq", "8", "--dtype", "fp32",
            "--backend", "cpu", "--no-cache", "--max-candidates", "2"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "search failed: the composite plan does not match the reference: tolerance: planted" in err
    assert "Traceback" not in err


def test_fp16_transformer_composite_passes_the_reference_check():
    """Unit-normal weights made 4 fp16 layers chaotic (attention logits ~100): max_rel 0.24 for a correct plan."""
    from planner.core.tolerance import check_outputs

    g = transformer(4, 64, 8, "fp16")
    mp = plan_model(g, load_device("h200"))
    x = random_inputs(g, 0)
    problem, _, _ = check_outputs(mp.plan, execute_plan(mp.plan, x), execute_graph(g, x))
    assert problem is None


def _cache_with_entry(root):
    plan_model(mlp_stack(2, 16, 4), load_device("h200"), cache=PlanCache(root))
    (entry,) = root.glob("*.json")
    return entry


def test_cache_clear_leaves_foreign_files_alone(tmp_path, capsys):
    """A cache folder that also holds a project: clear refuses, --force removes only the cache's entries."""
    root = tmp_path / "project"
    root.mkdir()
    entry = _cache_with_entry(root)
    leftover = root / f"{entry.stem}.x1y2z3.tmp"
    leftover.write_text("{")
    foreign = {root / "main.py": "print('hi')", root / "notes.json": "{}",
               root / ("0" * 32 + ".json"): json.dumps({"format": "fusion-planner-plan", "meta": {}})}
    for p, text in foreign.items():
        p.write_text(text)
    (root / "src").mkdir()
    (root / "src" / "lib.py").write_text("x = 1")
    outside = tmp_path / "outside.json"
    outside.write_text(entry.read_text())
    (root / ("f" * 32 + ".json")).symlink_to(outside)  # never followed out of the cache

    assert main(["cache", "clear", "--cache-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert "did not write" in err and "nothing removed" in err
    assert entry.exists() and all(p.exists() for p in foreign)

    assert main(["cache", "clear", "--cache-dir", str(root), "--force"]) == 0
    assert "removed 2 cached plan(s)" in capsys.readouterr().out  # the entry and the interrupted write
    assert not entry.exists() and not leftover.exists()
    assert all(p.read_text() == text for p, text in foreign.items())
    assert (root / "src" / "lib.py").exists() and outside.exists() and (root / ("f" * 32 + ".json")).is_symlink()


def test_cache_clear_refuses_a_file_and_ignores_a_missing_folder(tmp_path, capsys):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("data")
    assert main(["cache", "clear", "--cache-dir", str(not_a_dir)]) == 2
    assert not_a_dir.read_text() == "data"
    assert main(["cache", "clear", "--cache-dir", str(tmp_path / "missing")]) == 0
    assert "removed 0" in capsys.readouterr().out


def test_a_cache_that_cannot_be_written_keeps_the_result(tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    g = mlp_stack(2, 16, 4)
    with caplog.at_level("WARNING"):
        mp = plan_model(g, load_device("h200"), cache=PlanCache(not_a_dir))
    assert mp.plan.kernels and "could not store the plan" in caplog.text and not_a_dir.read_text() == ""


def test_a_cache_others_may_write_to_is_not_read(tmp_path, caplog):
    root = tmp_path / "shared"
    g = mlp_stack(2, 16, 4)
    plan_model(g, load_device("h200"), cache=PlanCache(root))
    assert plan_model(g, load_device("h200"), cache=PlanCache(root)).cache_hits == 1
    root.chmod(0o777)
    with caplog.at_level("WARNING"):
        assert plan_model(g, load_device("h200"), cache=PlanCache(root)).cache_hits == 0
    assert "others may write to it" in caplog.text


def test_a_graph_past_the_segment_limit_is_planned_in_segments(caplog):
    g = long_chain(300)
    mp = plan_model(g, load_device("h200"), limits=Limits(max_segment_ops=64))
    assert len(mp.regions) >= 5 and all(len(r.ops) <= 64 for r in mp.regions)
    assert mp.notes and "max_segment_ops=64" in mp.notes[0] and "no kernel spans a cut" in mp.notes[0]
    x = random_inputs(g, 0)
    np.testing.assert_allclose(execute_plan(mp.plan, x)[0], execute_graph(g, x)[0], rtol=1e-5, atol=1e-6)
    assert len(mp.plan.kernels) < len(mp.unfused.kernels) == 300
    assert all(len(k.ops) <= 64 for k in mp.plan.kernels)
    # --no-dedup searches each segment on its own: none shares another's plan
    whole = plan_model(g, load_device("h200"), limits=Limits(max_segment_ops=64), dedup=False)
    assert not whole.dedup and len(whole.unique) == len(whole.regions) and whole.notes
    assert plan_model(g, load_device("h200"), limits=Limits(max_segment_ops=300)).notes == []


def test_segments_share_the_time_budget(monkeypatch):
    import planner.cluster.jobs as jobs
    import planner.pipeline as pipeline
    from backends.reference import ReferenceBackend
    from planner.core.cost import load_device
    from planner.rules.load import load_rules
    from planner.search.results import SearchOptions

    budgets = []
    real = jobs.search

    def spy(cands, backend, inputs=None, *, options, **kw):
        budgets.append(options.time_budget_s)
        return real(cands, backend, inputs, options=options, **kw)

    monkeypatch.setattr(jobs, "search", spy)
    spec = load_device("h200")
    opts = pipeline.PlanOptions("reference", spec, load_rules(), Limits(max_segment_ops=64),
                                search=SearchOptions(time_budget_s=5.0))
    planned = pipeline.plan_graph(long_chain(300), opts, ReferenceBackend(spec), cache=None)
    assert planned.model is not None and len(budgets) == len(planned.model.unique) >= 5
    # the first of five searches gets a fifth; each later one what is left over those still to search
    assert budgets[0] <= 5.0 / len(budgets) and all(b <= 5.0 for b in budgets)


def test_the_composite_check_computes_the_fp64_oracle_only_when_the_tolerance_needs_it(monkeypatch):
    """A whole model checked against the reference runs its fp64 oracle only for an output outside the tolerance
    (a large model in fp64 took 1-2 s of a cold plan), as the search does."""
    from _fake_backend import TimedReferenceBackend

    from planner import pipeline
    from planner.search.results import SearchOptions

    mp = plan_model(mlp_stack(2, 32, 4), load_device("h200"))
    modes: list[str] = []
    real_execute = pipeline.execute_graph

    def execute(graph, inputs, mode="device"):  # noqa: ANN001, ANN202
        modes.append(mode)
        return real_execute(graph, inputs, mode)

    monkeypatch.setattr(pipeline, "execute_graph", execute)
    opts = SearchOptions(warmup=0, repeats=1)
    out = pipeline.measure_composite(mp, TimedReferenceBackend(load_device("h200")), opts)
    assert out["verified"] == "whole graph" and "oracle" not in modes

    real_check = pipeline.check_outputs

    def strict_without_oracle(plan, outs, expected, rtol=None, atol=None, oracle=None):  # noqa: ANN001, ANN202
        if oracle is None:
            return "tolerance: output y max_abs 1 max_rel 1 (fp32)", 1.0, 1.0
        return real_check(plan, outs, expected, rtol, atol, oracle)

    monkeypatch.setattr(pipeline, "check_outputs", strict_without_oracle)
    modes.clear()
    out = pipeline.measure_composite(mp, TimedReferenceBackend(load_device("h200")), opts)
    assert out["verified"] == "whole graph" and modes.count("oracle") == 1

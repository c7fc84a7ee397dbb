"""The search fanned out over a local Ray cluster of two workers: the serial search's plans, a worker killed
mid-search, a worker that hangs, and the executor refused where Ray is missing."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time

import pytest
import ray

from planner.cli import main
from planner.cluster.jobs import Budget
from planner.cluster.pool import NAMESPACE, ExecutorOptions, RayPool, join_ending_cluster
from planner.cluster.workers import RegionWorker
from planner.core import examples
from planner.core.cost import load_device
from planner.core.errors import UsageError
from planner.core.regions import split_regions
from planner.model.plancache import PlanCache
from planner.pipeline import PlanOptions, plan_graph
from planner.registry import get_backend, plugin
from planner.rules.load import load_rules
from planner.search.engine import SearchError
from planner.search.results import SearchOptions

SPEC = load_device("h200")
#: a layer stack of six distinct regions
STACK = examples.transformer(2, 64, 16, "fp32")


def model_options(executor: ExecutorOptions, budget_s: float = 60.0) -> PlanOptions:
    return PlanOptions("model", SPEC, tuple(load_rules()), search=SearchOptions(max_candidates=8,
                       time_budget_s=budget_s), executor=executor)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    yield
    ray.shutdown()


def test_the_cli_starts_a_local_cluster_and_plans_every_region_on_its_workers(capsys):
    assert not ray.is_initialized()
    code = main(["plan", "--example", "transformer", "--layers", "2", "--d-model", "64", "--seq", "16", "--dtype",
                 "fp32", "--backend", "cpu", "--max-candidates", "4", "--executor", "ray", "--workers", "2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["unique_regions"] == 6 and doc["verified"] == "whole graph"
    assert doc["executor"][0] == "searched on 2 workers (1 core each) of a local Ray cluster"
    cores = {note.rsplit("cores ", 1)[1] for note in doc["executor"][1:]}
    assert len(cores) == 2  # each worker times on a core of its own
    join_ending_cluster()  # it ends in the background
    assert not ray.is_initialized()  # the cluster it started is gone


def test_a_local_clusters_workers_import_the_planner_as_they_start_and_it_ends_in_the_background():
    pool = RayPool(ExecutorOptions("ray", 1), "model", SPEC, {}, "cpu")
    try:
        @ray.remote(num_cpus=0)
        def loaded() -> list[str]:  # a task: any worker process of the cluster, not the pool's actor
            return [m for m in ("planner.cluster.workers", "backends.model") if m in sys.modules]

        assert ray.get(loaded.remote()) == ["planner.cluster.workers", "backends.model"]
    finally:
        pool.close()
    again = RayPool(ExecutorOptions("ray", 1), "model", SPEC, {}, "cpu")  # waits for the first one's end
    try:
        assert again.started_cluster and len(again.pids()) == 1
    finally:
        again.close()
    join_ending_cluster()
    assert not ray.is_initialized()


def test_the_ray_executor_chooses_the_serial_searchs_plans(cluster):
    backend = get_backend("model", SPEC)
    serial = plan_graph(STACK, model_options(ExecutorOptions()), backend, cache=None)
    fanned = plan_graph(STACK, model_options(ExecutorOptions("ray", 2)), backend, cache=None)
    assert fanned.model is not None and serial.model is not None
    assert fanned.plan.key == serial.plan.key
    assert [u.plan.key for u in fanned.model.unique.values()] == [u.plan.key for u in serial.model.unique.values()]
    assert fanned.region_searches.keys() == serial.region_searches.keys()
    for name, result in fanned.region_searches.items():
        assert result.best.key == serial.region_searches[name].best.key
        assert all(line.startswith(("[w1] ", "[w2] ")) for line in result.log_lines)
    # one log, in the regions' order, as the serial search writes it
    headers = [line.split("] ", 1)[1] for line in fanned.log_lines if "] Search " in line]
    assert headers == [line for line in serial.log_lines if line.startswith("Search ")]
    assert fanned.executor_notes[0].startswith("searched on 2 workers")


def test_a_graph_searched_whole_runs_on_a_worker_with_its_candidates(cluster):
    graph = examples.mlp_epilogue(16, 64, 64, "fp32")
    backend = get_backend("model", SPEC)
    serial = plan_graph(graph, model_options(ExecutorOptions()), backend, cache=None)
    fanned = plan_graph(graph, model_options(ExecutorOptions("ray", 1)), backend, cache=None)
    assert fanned.search is not None and fanned.candidates is not None
    assert fanned.plan.key == serial.plan.key and fanned.search.log_lines[0].startswith("[w1] Search ")


def test_one_region_on_two_workers_is_searched_in_parts_and_compared_on_one(cluster):
    graph = examples.ew_chain(6, 4096)
    backend = get_backend("model", SPEC)
    options = PlanOptions("model", SPEC, tuple(load_rules()), search=SearchOptions(max_candidates=16),
                          executor=ExecutorOptions("ray", 2))
    serial = plan_graph(graph, dataclasses.replace(options, executor=ExecutorOptions()), backend, cache=None)
    fanned = plan_graph(graph, options, backend, cache=None)
    assert fanned.search is not None and serial.search is not None
    headers = [line for line in fanned.search.log_lines if "] Search " in line]
    assert len(headers) == 3 and {h[:4] for h in headers[:2]} == {"[w1]", "[w2]"}  # two parts, then the final
    tried = [e.plan.key for e in fanned.search.entries if e.timed]
    assert len(tried) == len(set(tried)) > 8  # the parts tried different candidates
    assert fanned.plan.key == serial.plan.key  # the cost model's timings: the best of all parts wins


def jobs(options: PlanOptions) -> list:
    return [options.job(r) for r in {r.key: r for r in split_regions(STACK)}.values()]


def test_a_worker_killed_mid_search_has_its_region_requeued(cluster, caplog):
    options = model_options(ExecutorOptions("ray", 2))
    pool = RayPool(options.executor, "model", SPEC, {}, "cpu")
    try:
        todo = jobs(options)
        runs = pool.run(todo, Budget(60.0, len(todo)))
        first = next(runs)  # both workers have a region; kill the one that did not send this one
        victim = next(name for name in pool.pids() if name != first.worker)
        os.kill(pool.pids()[victim], signal.SIGKILL)
        outcomes = [first, *runs]
    finally:
        pool.close()
    assert sorted(o.plan.region.key for o in outcomes) == sorted(j.region.key for j in todo)  # nothing lost
    assert pool.died == 1 and pool.hung == 0
    assert any(f"{victim} died" in e and "re-queued" in e for e in pool.events)
    assert pool.summary().endswith("(1 died); finished with 1")


def test_a_worker_that_hangs_is_killed_and_replaced(cluster):
    options = model_options(ExecutorOptions("ray", 2, grace_s=3.0), budget_s=2.0)
    pool = RayPool(options.executor, "model", SPEC, {}, "cpu")
    try:
        os.kill(pool.pids()["w2"], signal.SIGSTOP)  # w2 takes a region and never answers
        todo = jobs(options)
        outcomes = list(pool.run(todo, Budget(2.0, len(todo))))
        assert "w2" not in pool.pids() and "w3" in pool.pids()
    finally:
        pool.close()
    assert sorted(o.plan.region.key for o in outcomes) == sorted(j.region.key for j in todo)
    assert pool.hung == 1 and any("w2 hung" in e and "w3 started" in e for e in pool.events)


def test_workers_take_the_planners_settings_with_no_runtime_env_of_their_own(cluster, monkeypatch):
    class Probe(RegionWorker):  # no runtime env: the actor may take a worker process Ray started ahead
        def setting(self, name: str) -> str | None:
            return os.environ.get(name)

        def runtime_env(self) -> dict:
            return dict(ray.get_runtime_context().runtime_env)

    monkeypatch.setenv("FUSION_PLANNER_PROBE", "from the planner")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("UNRELATED_PROBE", "kept here")
    pool = RayPool(ExecutorOptions("ray", 2), "model", SPEC, {}, "cpu", worker=Probe)
    try:
        for worker in pool.workers.values():
            assert ray.get(worker.handle.setting.remote("FUSION_PLANNER_PROBE")) == "from the planner"
            assert ray.get(worker.handle.setting.remote("OMP_WAIT_POLICY")) == "PASSIVE"
            assert ray.get(worker.handle.setting.remote("UNRELATED_PROBE")) is None
            assert ray.get(worker.handle.runtime_env.remote()) == {}
    finally:
        pool.close()


def test_more_workers_than_the_cluster_holds_is_refused(cluster):
    with pytest.raises(UsageError, match="too few for 3 worker"):
        RayPool(ExecutorOptions("ray", 3), "model", SPEC, {}, "cpu")


def test_a_gpu_backends_workers_each_need_a_gpu_of_the_cluster(cluster):
    assert plugin("cupy").worker_device == "gpu"
    with pytest.raises(UsageError, match="holds 0 GPUs: too few for 1 worker"):
        RayPool(ExecutorOptions("ray"), "cupy", SPEC, {}, "gpu")


def test_the_executor_is_refused_with_the_install_line_where_ray_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    code = main(["plan", "--example", "mlp-epilogue", "--executor", "ray"])
    assert code == 2 and "pip install 'fusion-planner[ray]'" in capsys.readouterr().err


def test_workers_without_the_ray_executor_are_refused(capsys):
    assert main(["plan", "--example", "mlp-epilogue", "--workers", "2"]) == 2
    assert "--executor ray" in capsys.readouterr().err


def test_regions_searched_before_every_worker_is_lost_stay_in_the_plan_cache(cluster, monkeypatch, tmp_path):
    real_run = RayPool.run

    def run_then_lose_every_worker(self, jobs, budget, after=None):
        runs = real_run(self, jobs, budget, after)
        yield next(runs)
        for pid in self.pids().values():
            os.kill(pid, signal.SIGKILL)
        yield from runs

    monkeypatch.setattr(RayPool, "run", run_then_lose_every_worker)
    cache = PlanCache(tmp_path)
    backend = get_backend("model", SPEC)
    with pytest.raises(SearchError, match="every Ray worker was lost"):
        plan_graph(STACK, model_options(ExecutorOptions("ray", 2)), backend, cache=cache)
    again = plan_graph(STACK, model_options(ExecutorOptions()), backend, cache=cache)
    assert again.model is not None and again.model.cache_hits >= 1


def test_the_python_api_takes_the_executor(cluster):
    import planner

    result = planner.plan(STACK, backend="model", executor="ray", workers=2, max_candidates=4)
    assert result.planned is not None and result.planned.executor_notes[0].startswith("searched on 2 workers")
    assert any(line.startswith("[w") for line in result.log)


def test_results_timed_elsewhere_are_not_fanned_out(tmp_path, capsys):
    measured = tmp_path / "measured.json"
    measured.write_text("{}")
    assert main(["plan", "--example", "mlp-epilogue", "--measured", str(measured), "--executor", "ray"]) == 2
    assert "nothing to fan out" in capsys.readouterr().err


def test_an_address_nothing_answers_on_is_refused_at_once(capsys):
    assert main(["plan", "--example", "mlp-epilogue", "--executor", "ray", "--ray-address", "127.0.0.1:1"]) == 2
    assert "cannot join the Ray cluster at 127.0.0.1:1" in capsys.readouterr().err


# -- kept workers: a standing cluster's next search takes the workers warm


def end_kept_workers() -> None:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == NAMESPACE:
            ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)


@pytest.fixture
def kept(cluster):
    yield
    end_kept_workers()


def searched(pool: RayPool, options: PlanOptions) -> list:
    todo = jobs(options)[:2]
    return list(pool.run(todo, Budget(60.0, len(todo))))


def test_kept_workers_serve_the_next_search_of_their_kind_warm(kept):
    options = model_options(ExecutorOptions("ray", 2, keep_s=60.0))
    first = RayPool(options.executor, "model", SPEC, {}, "cpu")
    try:
        outcomes = searched(first, options)
        pids = first.pids()
    finally:
        first.close()
    assert first.reused == 0 and {o.worker for o in outcomes} <= {"w1", "w2"}  # this search's names in its log
    second = RayPool(options.executor, "model", SPEC, {}, "cpu")
    try:
        assert sorted(second.pids().values()) == sorted(pids.values())  # the same processes, started once
        assert second.reused == 2 and all("kept from an earlier search" in e for e in second.events)
        assert len(searched(second, options)) == 2
    finally:
        second.close()


def test_a_kept_worker_another_search_holds_is_not_shared(kept):
    options = model_options(ExecutorOptions("ray", 1, keep_s=60.0))
    holder = RayPool(options.executor, "model", SPEC, {}, "cpu")
    try:
        other = RayPool(options.executor, "model", SPEC, {}, "cpu")  # the cluster's other core: a worker of its own
        try:
            assert set(other.pids().values()).isdisjoint(holder.pids().values()) and other.reused == 0
            assert len(searched(other, options)) == 2
        finally:
            other.close()
    finally:
        holder.close()
    both = RayPool(dataclasses.replace(options.executor, workers=2), "model", SPEC, {}, "cpu")
    try:
        assert both.reused == 2  # each released at its search's end
    finally:
        both.close()


def test_an_idle_kept_worker_ends_itself_after_its_keep(kept):
    options = model_options(ExecutorOptions("ray", 1, keep_s=1.0))
    pool = RayPool(options.executor, "model", SPEC, {}, "cpu")
    pid = pool.pids()["w1"]
    pool.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.2)
    assert not alive(pid)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_idle_kept_workers_of_another_kind_are_retired_for_their_cores(kept):
    options = model_options(ExecutorOptions("ray", 2, keep_s=60.0))
    RayPool(options.executor, "model", SPEC, {}, "cpu").close()  # two kept workers hold both cores, idle
    other_kind = RayPool(options.executor, "model", load_device("rtx5090"), {}, "cpu")
    try:
        assert other_kind.reused == 0 and len(other_kind.pids()) == 2
        assert sum("retired the idle kept worker" in e for e in other_kind.events) == 2
    finally:
        other_kind.close()


def test_workers_are_not_kept_where_the_search_starts_its_cluster():
    assert ExecutorOptions("ray", 2).keep_workers_s == 0 and ExecutorOptions("ray", address="auto").keep_workers_s == 600
    with pytest.raises(UsageError, match="option of the ray executor"):
        ExecutorOptions("serial", keep_s=10.0).validate()
    assert main(["plan", "--example", "mlp-epilogue", "--executor", "ray", "--keep-workers", "-1"]) == 2

"""Workers kept between searches on a standing cluster joined by its address (``ray start --head``, as a team's
cluster is): the next search takes them warm. The pools' own lease tests are in test_pool.py."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from planner.cluster.jobs import Budget
from planner.cluster.pool import ExecutorOptions, RayPool
from planner.cluster.workers import CORE_LOCKS
from planner.core import examples
from planner.core.cost import load_device
from planner.core.regions import split_regions
from planner.pipeline import PlanOptions
from planner.rules.load import load_rules
from planner.search.results import SearchOptions

SPEC = load_device("h200")
PORT = "6391"
RAY = str(Path(sys.executable).parent / "ray")


def wait_for_free_cores(timeout_s: float = 120.0) -> None:
    """Wait until no worker of an earlier test holds a core lock: one still exiting on a loaded machine can
    outlast a new worker's wait for its core (``CLAIM_WAIT_S``)."""
    if not CORE_LOCKS.exists():
        return
    deadline = time.monotonic() + timeout_s
    for core in sorted(os.sched_getaffinity(0)):
        fd = os.open(CORE_LOCKS / f"{core}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        pytest.fail(f"core {core} is still held by an earlier test's worker after {timeout_s:g} s")
                    time.sleep(0.2)
        finally:
            os.close(fd)  # released at once: the test's own workers claim it


@pytest.fixture
def standing_cluster():
    assert not ray.is_initialized()
    wait_for_free_cores()
    subprocess.run([RAY, "start", "--head", "--num-cpus", "2", "--port", PORT, "--include-dashboard=false"],
                   check=True, capture_output=True, timeout=120)
    try:
        yield "auto"  # the cluster started last on this machine, as `ray start` tells its users to join it
    finally:
        subprocess.run([RAY, "stop", "--force"], check=True, capture_output=True, timeout=120)


def test_the_next_search_joining_a_standing_cluster_takes_its_workers_warm(standing_cluster):
    options = PlanOptions("model", SPEC, tuple(load_rules()), search=SearchOptions(max_candidates=4),
                          executor=ExecutorOptions("ray", 2, address=standing_cluster))
    jobs = [options.job(r) for r in {r.key: r for r in split_regions(examples.transformer(1, 64, 16, "fp32"))}.values()]
    pids = []
    for _ in range(2):
        pool = RayPool(options.executor, "model", SPEC, {}, "cpu")
        try:
            assert len(list(pool.run(jobs, Budget(60.0, len(jobs))))) == len(jobs)
            pids.append(sorted(pool.pids().values()))
        finally:
            pool.close()
        assert not ray.is_initialized()  # the search left the cluster; its workers stay
    assert pids[0] == pids[1] and pool.reused == 2

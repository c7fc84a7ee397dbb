"""benchmarks/plan_stability.py's report: the target's spread is over the distinct plans chosen; what runs that
chose the same plan differ by is reported beside it, not counted as a different decision."""

from __future__ import annotations

import sys

import pytest
from testpaths import ROOT, benchmark_script


@pytest.fixture(scope="module")
def stability():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its siblings (cpu_peers, noise)
    try:
        yield benchmark_script("plan_stability")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def run(key: str, samples: list[float]) -> dict:
    return {"key": key, "samples_us": samples, "median_us": sorted(samples)[len(samples) // 2]}


def test_one_plan_chosen_every_time_has_no_spread_but_its_timing_noise_is_shown(stability):
    spread, same = stability.spreads([run("a", [100, 101, 99]), run("a", [120, 121, 119]), run("a", [110] * 3)])
    assert spread == 1.0
    assert same == pytest.approx(120 / 100)


def test_distinct_plans_are_compared_over_every_run_that_chose_each(stability):
    runs = [run("a", [100, 100, 100]), run("b", [130, 130, 130]), run("a", [120, 120, 120])]
    spread, same = stability.spreads(runs)
    assert spread == pytest.approx(130 / 110)  # a's calls pooled: 100 x3 and 120 x3, median 110
    assert same == pytest.approx(1.2)


def test_no_plan_chosen_twice_has_no_same_plan_figure(stability):
    spread, same = stability.spreads([run("a", [100] * 3), run("b", [105] * 3), run("c", [95] * 3)])
    assert spread == pytest.approx(105 / 95) and same is None

"""benchmarks/scaling.py's child process plans a small stack (the benchmark broke once when the planner's API
changed under it: a device name where a spec is taken)."""

from __future__ import annotations

from testpaths import benchmark_script


def test_the_scaling_child_plans_a_small_stack_with_and_without_dedup():
    scaling = benchmark_script("scaling")
    for dedup in (True, False):
        row = scaling.run(2, 64, 16, dedup)
        assert row["regions"] >= 1 and row["enodes"] > 0 and row["est_us"] > 0 and row["total"] > 0

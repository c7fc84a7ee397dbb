"""benchmarks/scaling.py's child process plans a small stack (the benchmark broke once when the planner's API
changed under it: a device name where a spec is taken)."""

from __future__ import annotations

import importlib.util

from testpaths import ROOT


def test_the_scaling_child_plans_a_small_stack_with_and_without_dedup():
    spec = importlib.util.spec_from_file_location("scaling", ROOT / "benchmarks" / "scaling.py")
    assert spec is not None and spec.loader is not None
    scaling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scaling)
    for dedup in (True, False):
        row = scaling.run(2, 64, 16, dedup)
        assert row["regions"] >= 1 and row["enodes"] > 0 and row["est_us"] > 0 and row["total"] > 0

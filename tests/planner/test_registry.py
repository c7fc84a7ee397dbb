"""Backends are plugins: found through the planner.backends entry points, or registered at run time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _fake_backend import TimedReferenceBackend
from testpaths import ROOT

from planner import registry
from planner.api import plan
from planner.backend import Backend, BackendPlugin
from planner.cli import main
from planner.core.cost import load_device
from planner.core.errors import UsageError
from planner.core.examples import ew_chain

SHIPPED = {"reference", "model", "cpu", "cupy", "measured"}


def test_the_shipped_backends_are_entry_points():
    assert set(registry.backend_names()) >= SHIPPED
    assert isinstance(registry.get_backend("model", load_device("h200")), Backend)
    assert "cupy" in registry.plugin("cupy").name and registry.plugin("cpu").options == {"threads"}


def test_a_backend_registered_at_run_time_plans_like_a_shipped_one():
    registry.register_backend(BackendPlugin("toy", TimedReferenceBackend, "times the numpy reference"))
    try:
        with pytest.raises(UsageError, match="already registered"):
            registry.register_backend(BackendPlugin("toy", TimedReferenceBackend, "again"))
        graph = ew_chain(3, 256, "fp32")
        result = plan(graph, backend="toy", device="h200", max_candidates=4, cache=False)
        assert result.search_result is not None and result.search_result.backend == "timed-reference"
        assert len(result.search_result.timed) >= 2
        x = {"x": np.linspace(-1, 1, 256, dtype=np.float32)}
        (got,) = result(x)
        assert got.shape == (256,)
    finally:
        registry.unregister_backend("toy")
    with pytest.raises(UsageError, match="unknown backend 'toy'"):
        registry.get_backend("toy", load_device("h200"))


def test_an_option_a_backend_does_not_take_is_refused_by_name():
    with pytest.raises(UsageError, match="a thread count applies to the cpu backend, not 'model'"):
        registry.get_backend("model", load_device("h200"), threads=2)


TOY_DIST = """
from planner.backend import BackendPlugin
from planner.core.reference import execute_plan
from planner.backend import Backend, CompiledPlan, Timing


class Replayed(CompiledPlan):
    def run(self, inputs):
        return execute_plan(self.plan, inputs, "device")

    def time(self, inputs, *, warmup=2, repeats=7, stop_if=None):
        return Timing([float(len(self.plan.kernels))], 0)


class ToyBackend(Backend):
    name = "toy-dist"

    def compile(self, plan):
        return Replayed(plan)


PLUGIN = BackendPlugin("toy-dist", ToyBackend, "a backend of another distribution")
"""


def test_a_backend_of_another_distribution_registers_through_its_entry_point(tmp_path):
    """A separately installed distribution: a module and a .dist-info naming it under planner.backends."""
    (tmp_path / "toy_backend.py").write_text(textwrap.dedent(TOY_DIST))
    info = tmp_path / "toy_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[planner.backends]\ntoy-dist = toy_backend:PLUGIN\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "from planner.cli import main\n"
            "raise SystemExit(main(['plan', '--example', 'ew-chain', '--k', '3', '--n', '64', '--backend', 'toy-dist',"
            " '--no-cache']))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "backend toy-dist" in out.stdout
    best = next(line for line in out.stdout.splitlines() if line.startswith("best: "))
    assert best.startswith("best: [5] ")  # its timing is the kernel count: the one-kernel plan wins


def test_an_entry_point_that_names_no_plugin_is_refused_by_name(tmp_path, monkeypatch):
    (tmp_path / "bad_backend.py").write_text("PLUGIN = 42\n")
    info = tmp_path / "bad_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[planner.backends]\nbad = bad_backend:PLUGIN\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.rediscover()
    try:
        with pytest.raises(UsageError, match="entry point 'bad'.*must name a BackendPlugin"):
            registry.plugins()
    finally:
        monkeypatch.undo()
        registry.rediscover()
    assert "bad" not in registry.backend_names()


def test_the_cli_lists_the_plugins_commands_and_columns(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "export-candidates" in out and "bench" in out  # the cupy plugin's commands
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    assert "--kernel-facts" in capsys.readouterr().out  # the cupy plugin's explain column

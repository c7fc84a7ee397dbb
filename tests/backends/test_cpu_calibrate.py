"""A cpu search is costed on this machine's calibrated spec: measured once, kept in the kernel cache, refreshed by
``fusion-planner calibrate``; a named device still wins."""

from __future__ import annotations

import importlib
import json

import pytest

from backends.cpu.calibrate import MACHINE_SPEC_FILE, Calibration, machine_spec
from planner.cli import main
from planner.registry import device_for

#: the module (``backends.cpu.calibrate`` as an attribute is the plugin's calibrate function)
calibration = importlib.import_module("backends.cpu.calibrate")


def _fake(bandwidth: float) -> Calibration:
    return Calibration(triad_gbps=bandwidth, launch_us=0.5, gemm_gflops={256: 90.0, 512: 100.0},
                       tiled_gemm_gflops=95.0, vector_gflops=50.0, cpu="test CPU", seconds=0.01)


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Calibrations counted, not run; a private kernel cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[float] = []

    def fake_calibrate() -> Calibration:
        calls.append(30.0 + len(calls))
        return _fake(calls[-1])

    monkeypatch.setattr(calibration, "calibrate_cpu", fake_calibrate)
    machine_spec.cache_clear()
    yield calls
    machine_spec.cache_clear()


def test_measured_once_then_read_from_the_kernel_cache(measured, tmp_path):
    first = machine_spec()
    assert first.name == "cpu-calibrated" and first.bandwidth_gbps == 30.0 and measured == [30.0]
    record = tmp_path / "fusion-planner" / "cpu" / MACHINE_SPEC_FILE
    assert json.loads(record.read_text())["spec"]["bandwidth_gbps"] == 30.0
    machine_spec.cache_clear()  # a new process
    assert machine_spec() == first and measured == [30.0]


def test_a_record_of_another_machine_or_a_broken_one_is_measured_again(measured, tmp_path):
    machine_spec()
    record = tmp_path / "fusion-planner" / "cpu" / MACHINE_SPEC_FILE
    doc = json.loads(record.read_text())
    doc["key"]["cpu"] = "another CPU"
    record.write_text(json.dumps(doc))
    machine_spec.cache_clear()
    assert machine_spec().bandwidth_gbps == 31.0
    record.write_text('{"key": ')
    machine_spec.cache_clear()
    assert machine_spec().bandwidth_gbps == 32.0 and len(measured) == 3


def test_the_backend_chooses_the_spec_unless_one_is_named(measured):
    assert device_for(None, "cpu").name == "cpu-calibrated"
    assert device_for("seed-k4", "cpu").name == "seed-k4"
    assert device_for(None, "reference").name == "h200"  # no default of its own: the planner's
    assert device_for(None, "model").name == "h200"


def test_calibrate_refreshes_the_spec_searches_use(measured, monkeypatch, capsys, tmp_path):
    import backends.cpu as cpu_plugin

    assert machine_spec().bandwidth_gbps == 30.0
    kept = tmp_path / "fusion-planner" / "cpu" / "streaming-1.json"
    kept.write_text('{"key": {}, "sizes": {}}')
    monkeypatch.setattr(cpu_plugin, "calibrate_cpu", lambda: _fake(77.0))
    assert main(["calibrate", "--backend", "cpu"]) == 0
    assert not kept.exists()  # the streaming verdicts are measured again
    capsys.readouterr()
    assert machine_spec().bandwidth_gbps == 77.0  # the refreshed record, not the first measurement
    assert main(["plan", "--example", "ew-chain", "--k", "2", "--n", "4096", "--backend", "cpu", "--no-cache",
                 "--max-candidates", "2"]) == 0
    assert "on cpu-calibrated, backend cpu" in capsys.readouterr().out


@pytest.mark.parametrize("cores", [1, 2])
def test_on_one_core_the_kernels_compile_before_the_gemms_are_timed(monkeypatch, cores):
    """On one core the compiler would share it with the GEMMs being timed: it finishes first there; with a core to
    spare it runs meanwhile."""
    events: list[str] = []

    class Compiling:
        def __init__(self, *_a, **_k) -> None:  # noqa: ANN002, ANN003
            pass

        def start_many(self, _sources):  # noqa: ANN001, ANN202
            events.append("compile started")
            return lambda: events.append("compile finished") or 0

    def timed(name):  # noqa: ANN001, ANN202
        def fn(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
            events.append(name)
            return 10.0
        return fn

    monkeypatch.setattr(calibration, "Compiler", Compiling)
    monkeypatch.setattr(calibration, "_cores", lambda: cores)
    for name in ("gemm_gflops", "tiled_gemm_gflops", "triad_gbps", "launch_us", "vector_gflops"):
        monkeypatch.setattr(calibration, name, timed(name))
    calibration.calibrate_cpu()
    assert events.count("compile finished") == 1
    first_gemm, finished = events.index("gemm_gflops"), events.index("compile finished")
    assert (finished < first_gemm) == (cores == 1)
    assert finished < events.index("triad_gbps")  # the generated kernels are timed after they are built

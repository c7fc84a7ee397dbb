"""Where streaming stores pay: measured once per size class and machine, kept, and followed by the backend."""

from __future__ import annotations

import numpy as np
import pytest

from backends.cpu import backend as cpu_backend
from backends.cpu import parallel, stream_probe
from backends.cpu.compiler import Compiler, CompilerUnavailable
from backends.cpu.memory import cache_levels
from backends.cpu.stream_probe import MARGIN, StreamProbe, bucket_of, time_kernel
from planner.backend import BackendUnavailable
from planner.core import examples
from planner.core.cost import load_device
from planner.core.reference import random_inputs
from planner.egraph.candidates import build_candidates

SPEC = load_device("seed-k4")
MiB = 1 << 20


def cpu(threads: int) -> cpu_backend.CpuBackend:
    try:
        return cpu_backend.CpuBackend(SPEC, threads=threads)
    except BackendUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")


def probe_timing(stream_us: float, plain_us: float) -> tuple[StreamProbe, list[int]]:
    asked: list[int] = []

    def measure(size: int) -> dict[str, float]:
        asked.append(size)
        return {"stream_us": stream_us, "plain_us": plain_us}

    return StreamProbe(floor=4 * MiB, ceiling=64 * MiB, measure=measure), asked


def test_bucket_is_the_power_of_two_at_or_below() -> None:
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4 * MiB, 8 * MiB - 1)] == [1, 1, 2, 2, 4 * MiB, 4 * MiB]


def test_below_the_floor_plain_and_from_the_ceiling_streaming_without_measuring() -> None:
    probe, asked = probe_timing(1.0, 100.0)
    assert not probe.pays(4 * MiB - 1)
    assert probe.pays(64 * MiB) and probe.pays(1 << 40)
    assert asked == []


def test_each_size_class_is_measured_once() -> None:
    probe, asked = probe_timing(80.0, 100.0)
    assert probe.pays(5 * MiB) and probe.pays(7 * MiB) and probe.pays(4 * MiB)
    assert probe.pays(9 * MiB) and probe.pays(63 * MiB)
    assert asked == [4 * MiB, 8 * MiB, 32 * MiB]


@pytest.mark.parametrize(("stream_us", "streams"), [(100.0, False), (100.0 * (1 - MARGIN / 2), False),
                                                     (100.0 * (1 - 2 * MARGIN), True), (120.0, False)])
def test_streaming_must_win_beyond_the_margin(stream_us: float, streams: bool) -> None:
    probe, _ = probe_timing(stream_us, 100.0)
    assert probe.pays(6 * MiB) is streams


def test_cache_levels_read_from_sysfs(tmp_path) -> None:
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                              (3, "Unified", "32M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert cache_levels(str(tmp_path)) == {1: 48 << 10, 2: 2 * MiB, 3: 32 * MiB}
    assert cache_levels(str(tmp_path / "missing")) == {}


@pytest.mark.parametrize("kind", ["flat", "row"])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_kind_of_kernel_is_timed_both_ways(threads: int, kind: str) -> None:
    pool = parallel.WorkerPool(threads)
    try:
        us = time_kernel(kind, 4 * MiB, pool)
    except CompilerUnavailable:
        pytest.skip("no C compiler")
    finally:
        pool.close()
    assert set(us) == {"stream_us", "plain_us"} and all(0 < v < 1e6 for v in us.values())


def test_each_timed_run_starts_with_its_own_arrays_evicted(monkeypatch) -> None:
    evicted: list[set[int]] = []
    timed: list[tuple[str, int]] = []
    real_evicting = stream_probe._evicting

    def recording(flush, *arrays):  # noqa: ANN001, ANN202
        evict = real_evicting(flush, *arrays)
        spans = {a.ctypes.data for a in arrays}

        def run() -> None:
            evict()
            evicted.append(spans)
        return run

    def fastest_of(calls, rounds, before=None):  # noqa: ANN001, ANN202
        assert before is not None and set(before) == set(calls)
        for _ in range(rounds + 1):
            for name, call in calls.items():
                before[name]()
                timed.append((name, len(evicted)))
                call()
        return {name: 1e-3 for name in calls}

    monkeypatch.setattr(stream_probe, "_evicting", recording)
    monkeypatch.setattr(stream_probe, "fastest_of", fastest_of)
    try:
        time_kernel("row", 4 * MiB)
    except CompilerUnavailable:
        pytest.skip("no C compiler")
    assert len(timed) == 2 * (stream_probe.ROUNDS + 1) and [n for _, n in timed] == list(range(1, len(timed) + 1))
    inputs = set.intersection(*evicted)
    assert len(inputs) == 1  # the shared input, and each form's own output
    assert len({frozenset(s - inputs) for s in evicted}) == 2 and all(len(s) == 2 for s in evicted)


def test_the_flush_kernel_keeps_the_values() -> None:
    try:
        flush = Compiler().function(stream_probe.FLUSH_SOURCE, 1)
    except CompilerUnavailable:
        pytest.skip("no C compiler")
    a = np.arange(100_003, dtype=np.float32)
    flush(a.ctypes.data, 0, a.nbytes, 0)
    assert np.array_equal(a, np.arange(100_003, dtype=np.float32))


def test_verdicts_timed_from_another_start_are_measured_again(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(stream_probe, "time_kernel", lambda kind, size, pool=None: {"stream_us": 1.0, "plain_us": 2.0})
    assert StreamProbe(floor=MiB, ceiling=64 * MiB).pays(2 * MiB)
    monkeypatch.setattr(stream_probe, "START", "back to back")
    assert StreamProbe(floor=MiB, ceiling=64 * MiB)._kept() == {}


def test_a_verdict_is_kept_for_this_machine(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    timed: list[int] = []

    def fake_copy(kind: str, size: int, pool: object = None) -> dict[str, float]:
        timed.append(size)
        return {"stream_us": 50.0, "plain_us": 100.0}

    monkeypatch.setattr(stream_probe, "time_kernel", fake_copy)
    first = StreamProbe(floor=MiB, ceiling=64 * MiB)
    assert first.pays(5 * MiB) and timed == [4 * MiB]
    second = StreamProbe(floor=MiB, ceiling=64 * MiB)
    second.verdicts.update(second._kept())
    assert second.verdicts == {("flat", 4 * MiB): True}
    assert second.pays(5 * MiB, "row") and timed == [4 * MiB, 4 * MiB]  # a row kernel: measured apart
    third = StreamProbe(floor=MiB, ceiling=64 * MiB)
    assert third._kept() == {("flat", 4 * MiB): True, ("row", 4 * MiB): True}
    other = StreamProbe(floor=MiB, ceiling=32 * MiB)  # another machine's (its caches differ): measured again
    assert other._kept() == {}
    two = StreamProbe(floor=MiB, ceiling=64 * MiB, threads=2)  # plans on 2 threads: measured apart, kept apart
    assert two._kept() == {} and two.pays(5 * MiB) and len(timed) == 3
    assert third._kept() == {("flat", 4 * MiB): True, ("row", 4 * MiB): True}


@pytest.mark.parametrize("streams", [True, False])
@pytest.mark.parametrize("kind", ["flat", "row"])
def test_the_backend_follows_the_measured_verdict_of_its_kind(monkeypatch, streams: bool, kind: str) -> None:
    graph = (examples.ew_chain(3, 1 << 18, "fp32") if kind == "flat" else  # 1 MiB in, 1 MiB out
             examples.rms_norm(256, 1024, "fp32", residual=False))  # 1 MiB in, 1 MiB out, a 4 KiB weight
    plan = min(build_candidates(graph, SPEC).plans, key=lambda p: len(p.kernels))
    assert len(plan.kernels) == 1
    probe, asked = probe_timing(50.0 if streams else 100.0, 100.0)
    probe.floor = MiB
    monkeypatch.setattr(cpu_backend, "machine_probe", lambda threads: probe)
    compiled = cpu(1).compile(plan)
    assert [f["streaming_stores"] for f in compiled.kernel_facts] == [streams]
    assert list(probe.verdicts) == [(kind, 2 * MiB)] and len(asked) == 1
    plain = cpu_backend.CpuBackend(SPEC, threads=1, stream_bytes=1 << 40).compile(plan)
    inputs = random_inputs(graph, seed=2)
    assert np.array_equal(compiled.run(inputs)[0], plain.run(inputs)[0])


def test_a_fixed_threshold_is_not_measured(monkeypatch) -> None:
    monkeypatch.setenv("FUSION_PLANNER_STREAM_BYTES", str(MiB))
    monkeypatch.setattr(cpu_backend, "machine_probe", lambda threads: pytest.fail("measured despite a fixed threshold"))
    graph = examples.ew_chain(3, 1 << 18, "fp32")
    plan = min(build_candidates(graph, SPEC).plans, key=lambda p: len(p.kernels))
    compiled = cpu(1).compile(plan)
    assert [f["streaming_stores"] for f in compiled.kernel_facts] == [True]


def test_forgetting_drops_every_thread_counts_verdicts(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(stream_probe, "time_kernel", lambda kind, size, pool=None: {"stream_us": 1.0, "plain_us": 2.0})
    for threads in (1, 2):
        assert StreamProbe(floor=MiB, ceiling=64 * MiB, threads=threads).pays(2 * MiB)
    assert len(list((tmp_path / "fusion-planner" / "cpu").glob("streaming-*.json"))) == 2
    assert stream_probe.forget_verdicts() == 2
    assert StreamProbe(floor=MiB, ceiling=64 * MiB)._kept() == {}

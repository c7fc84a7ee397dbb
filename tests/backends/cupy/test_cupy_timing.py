"""Offline checks of the GPU timing loop (cupy imports without a GPU; its CUDA calls are replaced here): each
timed run is preceded by an L2 flush that its events do not time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

gpu = pytest.importorskip("backends.cupy.gpu", exc_type=ImportError)


class _Stream:
    def __init__(self, order: list[str]) -> None:
        self.order = order

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        self.order.append("sync")


def _fake_cupy(order: list[str], l2_bytes: int) -> SimpleNamespace:
    class Event:
        def record(self, stream: object) -> None:
            order.append("event")

        def synchronize(self) -> None:
            pass

    class Scratch:
        def __init__(self, n: int) -> None:
            order.append(f"alloc {n}")

        def fill(self, value: int) -> None:
            order.append("flush")

    cuda = SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: 0.002,
                           Device=lambda: SimpleNamespace(attributes={"L2CacheSize": l2_bytes}))
    return SimpleNamespace(cuda=cuda, empty=lambda n, dtype: Scratch(n), uint8="uint8")


def test_each_timed_run_follows_an_untimed_flush_of_twice_the_l2(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    monkeypatch.setattr(gpu, "cp", _fake_cupy(order, 60 << 20))
    stream = _Stream(order)
    flush = gpu.l2_flusher(stream)
    samples = gpu.event_times(lambda: order.append("run"), stream, warmup=2, repeats=3, before=flush)
    assert samples == [2.0, 2.0, 2.0]
    assert order == ["alloc 125829120", "run", "run", "sync", *["flush", "event", "run", "event"] * 3]


def test_without_a_flush_the_runs_follow_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    monkeypatch.setattr(gpu, "cp", _fake_cupy(order, 60 << 20))
    gpu.event_times(lambda: order.append("run"), _Stream(order), warmup=0, repeats=2)
    assert order == ["sync", "event", "run", "event", "event", "run", "event"]


class _CapturingStream(_Stream):
    def __init__(self, order: list[str]) -> None:
        super().__init__(order)
        self.capturing = False

    def begin_capture(self) -> None:
        self.capturing = True

    def end_capture(self) -> SimpleNamespace:
        self.capturing = False
        return SimpleNamespace(launch=lambda stream: self.order.append("replay"))

    def is_capturing(self) -> bool:
        return self.capturing


def test_after_a_graph_replay_the_plan_runs_once_uncaptured(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmath frees a Matmul after waiting on the event of its last execution; an event recorded inside the
    capture is refused outside it, so the last execution before close() must not be the captured one."""
    order: list[str] = []
    monkeypatch.setattr(gpu, "cp", _fake_cupy(order, 60 << 20))
    stream = _CapturingStream(order)
    last_event: list[str] = []

    def library_step() -> None:
        last_event[:] = ["captured" if stream.capturing else "recorded"]

    prepared = gpu.CupyPrepared(SimpleNamespace(), {}, [library_step], (), stream)
    assert prepared.time_graph(warmup=1, repeats=2) == 2.0
    assert last_event == ["recorded"]
    assert order[-1] == "sync"


def test_each_step_is_timed_between_its_own_events_after_a_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    monkeypatch.setattr(gpu, "cp", _fake_cupy(order, 60 << 20))
    stream = _Stream(order)
    steps = [lambda: order.append("k0"), lambda: order.append("k1")]
    prepared = gpu.CupyPrepared(SimpleNamespace(), {}, steps, (), stream)
    assert prepared.time_steps(repeats=2) == [2.0, 2.0]
    assert order == ["alloc 125829120", *["flush", "event", "k0", "event", "k1", "event"] * 2]

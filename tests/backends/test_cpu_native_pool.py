"""The native worker pool: every part of a kernel runs exactly once, whoever claims it, from any caller."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from backends.codegen import CodegenError
from backends.cpu import native_pool, parallel
from backends.cpu.compiler import Compiler
from planner.backend import BackendError, BackendUnavailable
from planner.core import examples
from planner.core.cost import load_device
from planner.core.errors import UsageError
from planner.core.reference import random_inputs
from planner.egraph.candidates import build_candidates

#: part r0..r1 of this kernel adds one to counts[r0..r1] and writes its thread's id into owner[r0..r1]
COUNT_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
void fp_kernel(int64_t* restrict counts, int64_t* restrict owner, int64_t r0, int64_t r1, int64_t cols) {
    for (int64_t r = r0; r < r1; ++r) {
        for (volatile int64_t spin = 0; spin < cols; ++spin) {}
        counts[r] += 1;
        owner[r] = (int64_t)pthread_self();
    }
}
"""


def _count_kernel(compiler: Compiler):  # noqa: ANN202
    return compiler.function(COUNT_SOURCE, 2)


def test_every_part_runs_once_with_more_parts_than_threads(compiler: Compiler) -> None:
    pool = native_pool.NativePool(native_pool.start_library(compiler)(), 3, spin_us=0)
    fn = _count_kernel(compiler)
    counts, owner = np.zeros(700, np.int64), np.zeros(700, np.int64)
    parts = [[counts.ctypes.data, owner.ctypes.data, r0, r1, 20_000] for r0, r1 in parallel.split(700, 7)]
    for _ in range(20):
        pool.run(parallel.kernel_address(fn), 2, parts)
    assert np.array_equal(counts, np.full(700, 20))
    assert pool.threads == 3


def test_the_workers_take_parts_from_the_caller(compiler: Compiler) -> None:
    """Parts slow enough that the caller cannot run them all before a worker wakes: more than one thread ran."""
    pool = native_pool.NativePool(native_pool.start_library(compiler)(), 2, spin_us=0)
    fn = _count_kernel(compiler)
    counts, owner = np.zeros(64, np.int64), np.zeros(64, np.int64)
    pool.run(parallel.kernel_address(fn), 2, [[counts.ctypes.data, owner.ctypes.data, r, r + 1, 2_000_000]
                                          for r in range(64)])
    assert np.array_equal(counts, np.ones(64)) and len(set(owner.tolist())) == 2


def test_concurrent_callers_each_get_every_part(compiler: Compiler) -> None:
    """A caller that finds the pool busy runs its parts itself: nothing is lost or run twice."""
    pool = native_pool.NativePool(native_pool.start_library(compiler)(), 3, spin_us=30)
    fn = _count_kernel(compiler)
    arrays = [(np.zeros(90, np.int64), np.zeros(90, np.int64)) for _ in range(4)]
    failures: list[BaseException] = []

    def caller(counts: np.ndarray, owner: np.ndarray) -> None:
        try:
            for _ in range(50):
                pool.run(parallel.kernel_address(fn), 2, [[counts.ctypes.data, owner.ctypes.data, r0, r1, 200]
                                                      for r0, r1 in parallel.split(90, 5)])
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=caller, args=a) for a in arrays]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert all(np.array_equal(counts, np.full(90, 50)) for counts, _ in arrays)


def test_plans_on_several_threads_run_their_loops_on_the_shared_native_pool() -> None:
    from backends.cpu.backend import CpuBackend

    spec = load_device("seed-k4")
    try:
        one, three = CpuBackend(spec, threads=1), CpuBackend(spec, threads=3)
    except BackendUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")
    assert one.pool.native is None and three.pool.native is native_pool.shared_pool(three.compiler, 3)
    graph = examples.layer_norm(3 * parallel.MIN_ELEMENTS_PER_THREAD // 768 + 7, 768)
    inputs = random_inputs(graph, seed=2)
    for plan in build_candidates(graph, spec).plans[:4]:
        before = three.pool.native_runs
        want, got = one.compile(plan).run(inputs), three.compile(plan).run(inputs)
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))
        assert three.pool.native_runs > before


def test_a_kernel_with_more_pointers_than_the_pool_calls_runs_on_python_threads() -> None:
    pool = parallel.WorkerPool(2)

    class Refusing:
        max_pointers = 1
        runs_tasks = False

        def run(self, address: int, n_pointers: int, parts: object) -> None:
            raise AssertionError("a kernel of too many pointers reached the native pool")

    pool.native = Refusing()
    seen: list[tuple[int, ...]] = []
    pool.run_kernel(lambda *a: seen.append(a), 2, [[1, 2, 0, 1, 5], [1, 2, 1, 2, 5]])
    assert sorted(seen) == [(1, 2, 0, 1, 5), (1, 2, 1, 2, 5)] and pool.native_runs == 0


def test_the_spin_time_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_PLANNER_SPIN_US", "0")
    assert native_pool.spin_us_from_env() == 0
    monkeypatch.delenv("FUSION_PLANNER_SPIN_US")
    assert native_pool.spin_us_from_env() == native_pool.SPIN_US


def test_a_pool_attached_while_its_compiler_runs_is_made_when_a_kernel_first_needs_it(compiler: Compiler) -> None:
    """The backend starts the pool's build and works on; the first kernel run waits for it, once."""
    made: list[int] = []

    def pending() -> native_pool.NativePool | None:
        made.append(1)
        return native_pool.shared_pool(compiler, 2)

    pool = parallel.WorkerPool(2)
    pool.attach(pending)
    assert not made
    fn = _count_kernel(compiler)
    counts, owner = np.zeros(8, np.int64), np.zeros(8, np.int64)
    for _ in range(3):
        pool.run_kernel(fn, 2, [[counts.ctypes.data, owner.ctypes.data, r0, r1, 10] for r0, r1 in parallel.split(8, 2)])
    assert made == [1] and pool.native is native_pool.shared_pool(compiler, 2)
    assert pool.native_runs == 3 and np.array_equal(counts, np.full(8, 3))


def test_a_pool_whose_build_fails_is_none_and_says_why(compiler: Compiler, monkeypatch, caplog) -> None:
    def broken(_compiler: Compiler):  # noqa: ANN202
        raise CodegenError("cc failed on the pool")

    monkeypatch.setattr(native_pool, "start_library", broken)
    monkeypatch.setattr(native_pool, "_shared", {})
    with caplog.at_level("WARNING"):
        assert native_pool.start_shared_pool(compiler, 2)() is None
    assert "cc failed on the pool" in caplog.text


# ---------------------------------------------------------------- torch's OpenMP team


def _openmp_pool(compiler: Compiler, threads: int) -> native_pool.NativePool:
    pytest.importorskip("torch")
    address, why = native_pool.openmp_parallel()
    if address is None:
        pytest.skip(f"no OpenMP team: {why}")
    return native_pool.NativePool(native_pool.start_library(compiler)(), threads, spin_us=0, gomp_parallel=address)


def test_on_torchs_openmp_team_every_part_runs_once_and_the_team_shares_them(compiler: Compiler) -> None:
    pool = _openmp_pool(compiler, 2)
    fn = _count_kernel(compiler)
    counts, owner = np.zeros(64, np.int64), np.zeros(64, np.int64)
    for _ in range(5):
        pool.run(parallel.kernel_address(fn), 2, [[counts.ctypes.data, owner.ctypes.data, r, r + 1, 400_000]
                                              for r in range(64)])
    assert np.array_equal(counts, np.full(64, 5))
    assert len(set(owner.tolist())) == 2 and pool.route == "openmp" and pool.threads == 2


def test_python_tasks_run_once_each_on_the_team_and_a_failure_is_raised_after_all_ended(compiler: Compiler) -> None:
    pool = _openmp_pool(compiler, 2)
    ran: list[int] = []

    def task(i: int) -> None:
        if i == 1:
            raise ValueError("task 1 failed")
        ran.append(i)

    with pytest.raises(ValueError, match="task 1 failed"):
        pool.run_tasks([lambda i=i: task(i) for i in range(6)])  # type: ignore[misc]
    assert sorted(ran) == [0, 2, 3, 4, 5]
    workers = parallel.WorkerPool(2)
    workers.native = pool
    out = np.zeros(8)
    workers.run([lambda r=r: out.__setitem__(slice(r, r + 1), r + 1) for r in range(8)])  # type: ignore[misc]
    assert np.array_equal(out, np.arange(1, 9)) and workers.native_runs == 1
    workers.close()


def test_the_route_is_torchs_openmp_team_unless_the_environment_says_pthreads(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    if native_pool.openmp_parallel()[0] is None:
        pytest.skip("this torch does not run on OpenMP")
    assert native_pool.route_from_env()[0] == "openmp"
    monkeypatch.setenv(native_pool.POOL_ENV, "pthreads")
    assert native_pool.route_from_env() == ("pthreads", None)
    monkeypatch.setenv(native_pool.POOL_ENV, "openmp")
    monkeypatch.delitem(sys.modules, "torch")
    with pytest.raises(BackendError, match="FUSION_PLANNER_CPU_POOL=openmp.*torch is not loaded"):
        native_pool.route_from_env()
    monkeypatch.setenv(native_pool.POOL_ENV, "auto")
    assert native_pool.route_from_env() == ("pthreads", None)
    monkeypatch.setenv(native_pool.POOL_ENV, "gomp")
    with pytest.raises(UsageError, match="FUSION_PLANNER_CPU_POOL"):
        native_pool.route_from_env()

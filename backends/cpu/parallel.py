"""The CPU backend's worker threads: how many, how work is split, and how the other pools are held.

A plan's GEMM row blocks run on a pool of ``threads - 1`` Python worker threads plus the calling
thread (BLAS through numpy releases the GIL, so they run truly in parallel); idle workers block on a
queue.  Its generated C kernels run on the process's native pool of as many pthreads
(:mod:`backends.cpu.native_pool`), handed every part in one call, without GIL
hand-offs; its idle workers spin briefly, then sleep.  Neither spins while BLAS or torch runs a step.

The other pools are held through their APIs, never through environment variables (those are
read only when a pool starts, and the process has usually started them by now):

* BLAS (``threadpoolctl``) runs on one thread inside every kernel: the parallelism is ours,
  one GEMM row block per worker, so BLAS threads would only compete with our workers;
* torch's intra-op pool (``torch.set_num_threads``) gets the plan's thread count while a plan
  with torch-backed kernels runs, and its previous count back afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from planner.backend import BackendError
from planner.core.env import env_count

#: fewest output elements a worker gets: below this, handing work to a thread costs more than it saves
MIN_ELEMENTS_PER_THREAD = 1 << 15
#: fewest GEMM rows per worker (a block of fewer rows runs BLAS far below its peak)
MIN_GEMM_ROWS_PER_THREAD = 16
#: chunks of a flat loop start on multiples of this many elements (a 64-byte line of fp32)
CHUNK_ALIGN = 16


def available_cores() -> int:
    """The cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def count_from_env(name: str) -> int | None:
    """The non-negative integer in environment variable ``name``; None when it is unset or empty."""
    return env_count(name)


def threads_from_env() -> int:
    """``FUSION_PLANNER_THREADS`` when set (0 or empty: all available cores), else all available cores."""
    return count_from_env("FUSION_PLANNER_THREADS") or available_cores()


def check_threads(threads: int | None) -> int:
    """A thread count: ``None`` reads the environment; otherwise a positive integer."""
    if threads is None:
        return threads_from_env()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise BackendError(f"threads must be a positive integer, got {threads!r}")
    return threads


def kernel_address(fn: Callable[..., None]) -> int:
    """The entry point of a kernel loaded through ctypes."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0  # type: ignore[arg-type]


class KernelPool(Protocol):
    """Runs a loaded C kernel's parts in parallel (``native_pool.NativePool``), and Python tasks where
    ``runs_tasks``."""

    max_pointers: int
    route: str
    runs_tasks: bool

    def run(self, address: int, n_pointers: int, parts: Sequence[Sequence[int]]) -> None: ...

    def run_tasks(self, tasks: Sequence[Callable[[], None]]) -> None: ...


class WorkerPool:
    """``threads - 1`` blocking worker threads; :meth:`run` also uses the calling thread.  :meth:`run_kernel`
    runs a C kernel's parts on :attr:`native` where the backend attached one."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads - 1, thread_name_prefix="fusion-planner") if threads > 1 else None
        self.parallel_runs = 0  # calls that used more than one thread (tests count them)
        self._native: KernelPool | None = None
        self._pending: Callable[[], KernelPool | None] | None = None
        self.native_runs = 0  # of those, the ones the native pool ran

    @property
    def native(self) -> KernelPool | None:
        """The native pool attached (:meth:`attach`), the first run waiting for it to be made."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._native = pending()
        return self._native

    @native.setter
    def native(self, pool: KernelPool | None) -> None:
        self._pending, self._native = None, pool

    def attach(self, pending: Callable[[], KernelPool | None]) -> None:
        """Run kernels on the native pool ``pending()`` returns, called when a kernel first needs it (its compiler
        run overlaps the caller's work until then)."""
        self._pending = pending

    def run_kernel(self, fn: Callable[..., None], n_pointers: int, parts: Sequence[Sequence[int]]) -> None:
        """Call the loaded C kernel ``fn`` (``n_pointers`` pointers, then three integers) with each part's
        arguments, in parallel: on the native pool where there is one and the kernel fits it, else as tasks."""
        native = self.native  # once: a property (the pool may still be attaching), and this is every kernel's path
        if native is not None and len(parts) > 1 and n_pointers <= native.max_pointers:
            self.parallel_runs += 1
            self.native_runs += 1
            native.run(kernel_address(fn), n_pointers, parts)
            return
        self.run([functools.partial(fn, *part) for part in parts])

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run every task, the first on the calling thread (on the native pool where it runs tasks: torch's
        OpenMP team); re-raises the first failure after all ended."""
        if self._executor is None or len(tasks) < 2:
            for task in tasks:
                task()
            return
        self.parallel_runs += 1
        native = self.native
        if native is not None and native.runs_tasks:
            self.native_runs += 1
            native.run_tasks(tasks)
            return
        futures = [self._executor.submit(task) for task in tasks[1:]]
        first: BaseException | None = None
        try:
            tasks[0]()
        except BaseException as exc:  # noqa: BLE001 - every worker must finish before the buffers are reused
            first = exc
        for f in futures:
            failure = f.exception()  # waits for the task, failed or not
            if first is None:
                first = failure
        if first is not None:
            raise first

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def split(total: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``[0, total)`` in at most ``parts`` contiguous ranges of near-equal length, starts on ``align``."""
    if total <= 0:
        return []
    parts = max(1, min(parts, total))
    bounds, start = [], 0
    for i in range(parts):
        end = total if i == parts - 1 else min(total, -(-((i + 1) * total // parts) // align) * align)
        if end > start:
            bounds.append((start, end))
            start = end
    return bounds


def loop_parts(threads: int, elements: int) -> int:
    """How many workers a loop over ``elements`` outputs gets."""
    return max(1, min(threads, elements // MIN_ELEMENTS_PER_THREAD))


def gemm_parts(threads: int, rows: int) -> int:
    """How many row blocks a GEMM of ``rows`` rows is cut into, one per worker."""
    return max(1, min(threads, rows // MIN_GEMM_ROWS_PER_THREAD))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op pool at ``n`` threads inside the block, if torch is loaded (its count restored)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)

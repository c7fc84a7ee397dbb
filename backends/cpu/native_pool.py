"""Worker threads in C for the generated kernels.

A kernel split across cores through a Python pool pays, on every call, a queue hand-off, a thread
wake-up and two GIL acquisitions per worker before the worker's share starts: 50-100 µs on this
machine kind, which is a tenth of a 4M-element chain on two cores.  Here one ctypes call (which
releases the GIL) hands every part of a kernel to ``threads - 1`` pthreads and the calling thread;
the parts are claimed from an atomic counter, so a late worker leaves its part to the others.

Idle workers spin for :data:`SPIN_US` after a kernel (the next kernel of a plan usually follows
within it), then sleep on a condition variable: they never spin while BLAS or torch runs a longer
step.  One pool per process and thread count is shared by every plan and lives as long as the
process; a second caller that finds it busy runs its parts on its own thread rather than wait.

Where torch is loaded and runs on OpenMP, the parts run on torch's OpenMP team instead
(``$FUSION_PLANNER_CPU_POOL``: ``auto``, the default; ``openmp`` or ``pthreads`` force one): one
``GOMP_parallel`` call of the runtime torch loaded, the parts claimed from the same counter.  GNU
OpenMP's threads spin for milliseconds after each region (its default wait policy): on two cores here
(2026-12-07) a kernel split over our own pthreads within 3 ms of a torch product ran on one core, its
other worker waiting for the spinning OpenMP thread to be descheduled (a 128x768x3072 product split
over two threads took 6.6 ms there, 3.4 ms 10 ms later).  On the team torch's products ran on, a plan
that mixes oneDNN products and generated kernels keeps both cores: a 4M-element kernel right after a
product took 212-267 µs against 287-405 on the pthreads.

Every kernel :meth:`Compiler.function` loads takes ``n`` pointers and three ``int64_t``; the pool
calls it through a function pointer of that arity with ``void*`` pointers, exactly as ctypes does.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from backends.codegen import CodegenError
from backends.cpu import parallel
from backends.cpu.compiler import Compiler
from planner.backend import BackendError
from planner.core.env import env_choice

log = logging.getLogger(__name__)

#: the most pointer arguments a kernel run by the pool may take (more: the Python pool runs it)
MAX_POINTERS = 32
#: how long an idle worker spins for the next kernel before it sleeps ($FUSION_PLANNER_SPIN_US)
SPIN_US = 30
POOL_ENV = "FUSION_PLANNER_CPU_POOL"
ROUTES = ("openmp", "pthreads")
#: the OpenMP runtimes torch's wheels load (GNU's; Intel's, which also answers GNU's entry points)
OPENMP_RUNTIMES = ("libgomp.so.1", "libiomp5.so")
#: task ``i`` of :meth:`NativePool.run_tasks`, called from the C side
_TASK = ctypes.CFUNCTYPE(None, ctypes.c_int64)

_HEAD = r"""
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef int64_t I;
typedef void* P;

typedef struct fp_job {
    void* fn;
    int n_ptr;
    const int64_t* args;
    int64_t parts;
    atomic_llong next, done;
    atomic_int active;
} fp_job;

typedef struct fp_pool {
    pthread_mutex_t mu, run_mu;
    pthread_cond_t cv;
    atomic_llong gen;
    fp_job* job;
    int sleepers, workers;
    int64_t spin_ns;
    pthread_t* tids;
} fp_pool;

static int64_t fp_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void fp_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
"""

_TAIL = r"""
static void fp_work(fp_job* job) {
    const int64_t m = job->n_ptr + 3;
    int64_t i;
    while ((i = atomic_fetch_add(&job->next, 1)) < job->parts) {
        fp_call(job->fn, job->n_ptr, job->args + i * m);
        atomic_fetch_add(&job->done, 1);
    }
}

static void* fp_worker(void* arg) {
    fp_pool* p = arg;
    long long seen = 0;
    for (;;) {
        const int64_t until = fp_now_ns() + p->spin_ns;
        for (int k = 1; atomic_load(&p->gen) == seen; ++k) {
            fp_relax();
            if (k % 64 == 0 && fp_now_ns() > until) break;
        }
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->gen) == seen) {
            p->sleepers++;
            pthread_cond_wait(&p->cv, &p->mu);
            p->sleepers--;
        }
        seen = atomic_load(&p->gen);
        fp_job* job = p->job;  /* NULL when the caller has already finished it */
        if (job) atomic_fetch_add(&job->active, 1);
        pthread_mutex_unlock(&p->mu);
        if (job) {
            fp_work(job);
            atomic_fetch_sub(&job->active, 1);
        }
    }
}

fp_pool* fp_pool_new(int workers, int64_t spin_ns) {
    fp_pool* p = calloc(1, sizeof(fp_pool));
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->run_mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    atomic_init(&p->gen, 0);
    p->spin_ns = spin_ns;
    p->tids = calloc((size_t)(workers > 0 ? workers : 1), sizeof(pthread_t));
    if (!p->tids) {
        free(p);
        return NULL;
    }
    for (int i = 0; i < workers; ++i) {
        if (pthread_create(&p->tids[i], NULL, fp_worker, p) != 0) break;
        p->workers++;
    }
    return p;
}

int fp_pool_workers(fp_pool* p) { return p->workers; }

/* Every part i calls fn with args[i * (n_ptr + 3) ...]; returns when all have ended. */
void fp_pool_run(fp_pool* p, void* fn, int n_ptr, const int64_t* args, int64_t parts) {
    const int64_t m = n_ptr + 3;
    if (parts < 2 || p->workers == 0 || pthread_mutex_trylock(&p->run_mu) != 0) {
        for (int64_t i = 0; i < parts; ++i) fp_call(fn, n_ptr, args + i * m);
        return;
    }
    fp_job job = {.fn = fn, .n_ptr = n_ptr, .args = args, .parts = parts};
    atomic_init(&job.next, 0);
    atomic_init(&job.done, 0);
    atomic_init(&job.active, 0);
    pthread_mutex_lock(&p->mu);
    p->job = &job;
    atomic_fetch_add(&p->gen, 1);
    if (p->sleepers) pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    fp_work(&job);
    pthread_mutex_lock(&p->mu);
    p->job = NULL;  /* no worker joins after this; those that joined are counted in active */
    pthread_mutex_unlock(&p->mu);
    for (int k = 1; atomic_load(&job.done) < parts || atomic_load(&job.active) > 0; ++k) {
        fp_relax();
        if (k % 4096 == 0) sched_yield();  /* a worker was preempted: let it run */
    }
    pthread_mutex_unlock(&p->run_mu);
}
"""


_OPENMP = r"""
/* The same parts on the OpenMP team of the runtime whose GOMP_parallel is passed (torch's): its threads are the
   ones torch's products just ran on, still spinning for the next region, not a second pool competing for cores. */
typedef void (*fp_gomp_parallel)(void (*)(void*), void*, unsigned, unsigned);

static void fp_omp_body(void* job) { fp_work(job); }

void fp_omp_run(void* gomp_parallel, int threads, void* fn, int n_ptr, const int64_t* args, int64_t parts) {
    fp_job job = {.fn = fn, .n_ptr = n_ptr, .args = args, .parts = parts};
    atomic_init(&job.next, 0);
    atomic_init(&job.done, 0);
    atomic_init(&job.active, 0);
    ((fp_gomp_parallel)gomp_parallel)(fp_omp_body, &job, (unsigned)(parts < threads ? parts : threads), 0);
}

/* Tasks 0..n-1 by calling task(i) (a Python callable through ctypes, which takes the GIL for it) on the team. */
typedef struct fp_tasks {
    void (*task)(int64_t);
    int64_t n;
    atomic_llong next;
} fp_tasks;

static void fp_tasks_body(void* arg) {
    fp_tasks* t = arg;
    int64_t i;
    while ((i = atomic_fetch_add(&t->next, 1)) < t->n) t->task(i);
}

void fp_omp_tasks(void* gomp_parallel, int threads, void (*task)(int64_t), int64_t n) {
    fp_tasks t = {.task = task, .n = n};
    atomic_init(&t.next, 0);
    ((fp_gomp_parallel)gomp_parallel)(fp_tasks_body, &t, (unsigned)(n < threads ? n : threads), 0);
}
"""


def pool_source(max_pointers: int = MAX_POINTERS) -> str:
    """The pool's C source: a call of each arity from 1 to ``max_pointers`` pointers, then the pool."""
    cases = []
    for n in range(1, max_pointers + 1):
        types = ", ".join(["P"] * n + ["I"] * 3)
        args = ", ".join([f"(P)a[{i}]" for i in range(n)] + [f"a[{n + j}]" for j in range(3)])
        cases.append(f"    case {n}: ((void (*)({types}))fn)({args}); return;")
    call = ("static void fp_call(void* fn, int n, const int64_t* a) {\n    switch (n) {\n"
            + "\n".join(cases) + "\n    default: return;\n    }\n}\n")
    return _HEAD + call + _TAIL + _OPENMP


def spin_us_from_env() -> int:
    n = parallel.count_from_env("FUSION_PLANNER_SPIN_US")
    return SPIN_US if n is None else n


def openmp_parallel() -> tuple[int | None, str]:
    """(the address of ``GOMP_parallel`` in the OpenMP runtime torch runs on, or None; why not, when None)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, "torch is not loaded"
    if not torch._C.has_openmp:
        return None, "this torch does not run on OpenMP"
    for name in OPENMP_RUNTIMES:
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_NOW)  # only the one already loaded
            return ctypes.cast(runtime.GOMP_parallel, ctypes.c_void_p).value, ""
        except (OSError, AttributeError):
            continue
    return None, f"none of {', '.join(OPENMP_RUNTIMES)} is loaded with GOMP_parallel"


def route_from_env() -> tuple[str, int | None]:
    """(``openmp`` or ``pthreads``, GOMP_parallel's address for openmp): ``$FUSION_PLANNER_CPU_POOL``, where
    ``auto`` (the default) takes torch's OpenMP team where there is one; ``openmp`` where there is none is an
    error that says why."""
    choice = env_choice(POOL_ENV, ("auto", *ROUTES), "auto")
    if choice == "pthreads":
        return "pthreads", None
    address, why = openmp_parallel()
    if address is None and choice == "openmp":
        raise BackendError(f"{POOL_ENV}=openmp, but there is no OpenMP team to run on ({why})")
    return ("openmp", address) if address is not None else ("pthreads", None)


class NativePool:
    """``threads - 1`` pthreads that run a loaded kernel's parts, or ``threads`` of torch's OpenMP team where
    ``gomp_parallel`` (its runtime's entry point) is given (see the module docstring)."""

    def __init__(self, library: Path, threads: int, spin_us: int, gomp_parallel: int | None = None) -> None:
        """The pool of the compiled :func:`pool_source` at ``library`` (:func:`start_library`)."""
        lib = ctypes.CDLL(str(library))
        lib.fp_pool_new.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.fp_pool_new.restype = ctypes.c_void_p
        lib.fp_pool_workers.argtypes = [ctypes.c_void_p]
        lib.fp_pool_workers.restype = ctypes.c_int
        lib.fp_pool_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
        lib.fp_pool_run.restype = None
        lib.fp_omp_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                   ctypes.c_int64]
        lib.fp_omp_run.restype = None
        lib.fp_omp_tasks.argtypes = [ctypes.c_void_p, ctypes.c_int, _TASK, ctypes.c_int64]
        lib.fp_omp_tasks.restype = None
        self._lib = lib
        self._gomp_parallel = gomp_parallel
        self.route = "pthreads" if gomp_parallel is None else "openmp"
        #: Python tasks run here too (:meth:`run_tasks`): on the OpenMP team, where the other route would be a
        #: third pool beside it and torch's
        self.runs_tasks = gomp_parallel is not None
        self.max_pointers = MAX_POINTERS
        if gomp_parallel is not None:
            self._handle, self.threads = None, threads
            return
        self._handle = lib.fp_pool_new(threads - 1, spin_us * 1000)
        if not self._handle:
            raise CodegenError("the native worker pool could not allocate its state")
        self.threads = 1 + lib.fp_pool_workers(self._handle)
        if self.threads < threads:
            log.warning("the native worker pool started %d of %d threads", self.threads - 1, threads - 1)

    def run(self, address: int, n_pointers: int, parts: Sequence[Sequence[int]]) -> None:
        """Call the kernel at ``address`` with each part's arguments (``n_pointers`` addresses, then three
        integers), the parts in parallel; returns when every part has ended."""
        flat = [v for part in parts for v in part]
        args = (ctypes.c_int64 * len(flat))(*flat)
        if self._gomp_parallel is not None:
            self._lib.fp_omp_run(self._gomp_parallel, self.threads, address, n_pointers, args, len(parts))
            return
        self._lib.fp_pool_run(self._handle, address, n_pointers, args, len(parts))

    def run_tasks(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run every task on the OpenMP team (each takes the GIL through ctypes' callback; a GEMM block releases
        it inside BLAS); re-raises the first failure after all ended."""
        if self._gomp_parallel is None:
            raise CodegenError("Python tasks run on the OpenMP route only")
        failures: list[BaseException] = []

        def one(i: int) -> None:
            try:
                tasks[i]()
            except BaseException as exc:  # noqa: BLE001 - raised below, once every task has ended
                failures.append(exc)

        self._lib.fp_omp_tasks(self._gomp_parallel, self.threads, _TASK(one), len(tasks))
        if failures:
            raise failures[0]


_shared: dict[tuple[int, int, int, str], NativePool | None] = {}
_shared_lock = threading.Lock()


def start_library(compiler: Compiler) -> Callable[[], Path]:
    """The pool's shared object, its compiler run started (``Compiler.start_build``)."""
    return compiler.start_build(pool_source(), extra=("-pthread",))


def shared_pool(compiler: Compiler, threads: int) -> NativePool | None:
    """This process's pool of ``threads`` threads on the route :func:`route_from_env` takes (made on first use;
    a forked child makes its own), or None when it cannot be built (the caller then runs kernels on its Python
    pool; the reason is logged)."""
    return start_shared_pool(compiler, threads)()


def start_shared_pool(compiler: Compiler, threads: int) -> Callable[[], NativePool | None]:
    """:func:`shared_pool`, its compiler run started where the pool is not made yet: the caller works meanwhile
    (a cold kernel cache compiles the pool for about 0.3 s), then calls what this returns."""
    route, gomp_parallel = route_from_env()
    key = (os.getpid(), threads, spin_us_from_env(), route)
    with _shared_lock:
        if key in _shared:
            made = _shared[key]
            return lambda: made
    try:
        library = start_library(compiler)
    except (CodegenError, OSError) as exc:
        return functools.partial(_made, key, exc, gomp_parallel)

    def finish() -> NativePool | None:
        try:
            return _made(key, library(), gomp_parallel)  # waited for even where another caller made the pool
        except (CodegenError, OSError) as exc:
            return _made(key, exc, gomp_parallel)

    return finish


def _made(key: tuple[int, int, int, str], library: Path | Exception, gomp_parallel: int | None) -> NativePool | None:
    """The shared pool of ``key``: the one made already, else made from ``library``; None where the library's
    build failed (``library`` is the error) or the pool cannot start (the reason is logged)."""
    with _shared_lock:
        if key not in _shared:
            _shared[key] = _new_pool(library, key[1], key[2], gomp_parallel)
        return _shared[key]


def _new_pool(library: Path | Exception, threads: int, spin_us: int, gomp_parallel: int | None) -> NativePool | None:
    failure = library if isinstance(library, Exception) else None
    if not isinstance(library, Exception):
        try:
            return NativePool(library, threads, spin_us, gomp_parallel)
        except (CodegenError, OSError) as exc:
            failure = exc
    log.warning("no native worker pool (%s); kernels are split across Python threads", failure)
    return None

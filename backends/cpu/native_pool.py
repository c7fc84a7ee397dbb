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

Every kernel :meth:`Compiler.function` loads takes ``n`` pointers and three ``int64_t``; the pool
calls it through a function pointer of that arity with ``void*`` pointers, exactly as ctypes does.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from backends.codegen import CodegenError
from backends.cpu import parallel
from backends.cpu.compiler import Compiler

log = logging.getLogger(__name__)

#: the most pointer arguments a kernel run by the pool may take (more: the Python pool runs it)
MAX_POINTERS = 32
#: how long an idle worker spins for the next kernel before it sleeps ($FUSION_PLANNER_SPIN_US)
SPIN_US = 30

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


def pool_source(max_pointers: int = MAX_POINTERS) -> str:
    """The pool's C source: a call of each arity from 1 to ``max_pointers`` pointers, then the pool."""
    cases = []
    for n in range(1, max_pointers + 1):
        types = ", ".join(["P"] * n + ["I"] * 3)
        args = ", ".join([f"(P)a[{i}]" for i in range(n)] + [f"a[{n + j}]" for j in range(3)])
        cases.append(f"    case {n}: ((void (*)({types}))fn)({args}); return;")
    call = ("static void fp_call(void* fn, int n, const int64_t* a) {\n    switch (n) {\n"
            + "\n".join(cases) + "\n    default: return;\n    }\n}\n")
    return _HEAD + call + _TAIL


def spin_us_from_env() -> int:
    n = parallel.count_from_env("FUSION_PLANNER_SPIN_US")
    return SPIN_US if n is None else n


class NativePool:
    """``threads - 1`` pthreads that run a loaded kernel's parts (see the module docstring)."""

    def __init__(self, library: Path, threads: int, spin_us: int) -> None:
        """The pool of the compiled :func:`pool_source` at ``library`` (:func:`start_library`)."""
        lib = ctypes.CDLL(str(library))
        lib.fp_pool_new.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.fp_pool_new.restype = ctypes.c_void_p
        lib.fp_pool_workers.argtypes = [ctypes.c_void_p]
        lib.fp_pool_workers.restype = ctypes.c_int
        lib.fp_pool_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
        lib.fp_pool_run.restype = None
        self._lib = lib
        self._handle = lib.fp_pool_new(threads - 1, spin_us * 1000)
        if not self._handle:
            raise CodegenError("the native worker pool could not allocate its state")
        self.max_pointers = MAX_POINTERS
        self.threads = 1 + lib.fp_pool_workers(self._handle)
        if self.threads < threads:
            log.warning("the native worker pool started %d of %d threads", self.threads - 1, threads - 1)

    def run(self, address: int, n_pointers: int, parts: Sequence[Sequence[int]]) -> None:
        """Call the kernel at ``address`` with each part's arguments (``n_pointers`` addresses, then three
        integers), the parts in parallel; returns when every part has ended."""
        flat = [v for part in parts for v in part]
        args = (ctypes.c_int64 * len(flat))(*flat)
        self._lib.fp_pool_run(self._handle, address, n_pointers, args, len(parts))


_shared: dict[tuple[int, int, int], NativePool | None] = {}
_shared_lock = threading.Lock()


def start_library(compiler: Compiler) -> Callable[[], Path]:
    """The pool's shared object, its compiler run started (``Compiler.start_build``)."""
    return compiler.start_build(pool_source(), extra=("-pthread",))


def shared_pool(compiler: Compiler, threads: int) -> NativePool | None:
    """This process's pool of ``threads`` threads (made on first use; a forked child makes its own), or None
    when it cannot be built (the caller then runs kernels on its Python pool; the reason is logged)."""
    return start_shared_pool(compiler, threads)()


def start_shared_pool(compiler: Compiler, threads: int) -> Callable[[], NativePool | None]:
    """:func:`shared_pool`, its compiler run started where the pool is not made yet: the caller works meanwhile
    (a cold kernel cache compiles the pool for about 0.3 s), then calls what this returns."""
    key = (os.getpid(), threads, spin_us_from_env())
    with _shared_lock:
        if key in _shared:
            made = _shared[key]
            return lambda: made
    try:
        library = start_library(compiler)
    except (CodegenError, OSError) as exc:
        return functools.partial(_made, key, exc)

    def finish() -> NativePool | None:
        try:
            return _made(key, library())  # waited for even where another caller made the pool: its run is reaped
        except (CodegenError, OSError) as exc:
            return _made(key, exc)

    return finish


def _made(key: tuple[int, int, int], library: Path | Exception) -> NativePool | None:
    """The shared pool of ``key``: the one made already, else made from ``library``; None where the library's
    build failed (``library`` is the error) or the pool cannot start (the reason is logged)."""
    with _shared_lock:
        if key not in _shared:
            _shared[key] = _new_pool(library, key[1], key[2])
        return _shared[key]


def _new_pool(library: Path | Exception, threads: int, spin_us: int) -> NativePool | None:
    failure = library if isinstance(library, Exception) else None
    if not isinstance(library, Exception):
        try:
            return NativePool(library, threads, spin_us)
        except (CodegenError, OSError) as exc:
            failure = exc
    log.warning("no native worker pool (%s); kernels are split across Python threads", failure)
    return None

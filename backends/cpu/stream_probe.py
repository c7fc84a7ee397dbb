"""Where streaming (non-temporal) stores pay on this machine: measured, not read off the cache size.

A kernel that writes its output with streaming stores sends it to memory without first reading the
destination's lines; one with plain stores reads each line into the cache first (unless it is there already)
and keeps it there, where the next kernel finds it.  Which is faster depends on how much of the last-level
cache a process really has: sysfs under a hypervisor can report the host's (480 MiB on one Intel VM), and on an
AMD EPYC with a 32 MiB L3 plain stores still won at 25 MiB.  So between twice the next-to-last cache level
(below: the arrays live in caches of the core's own, plain stores) and the last level sysfs reports (from there:
streaming), a kernel's traffic is rounded down to a power of two and, the first time a plan needs that size, a
kernel of its kind moving that many bytes is timed both ways, interleaved, on the plan's threads, split as the
backend splits it: a copy for a loop over elements, an RMSNorm of rows of 1024 for a row kernel (a row is
staged on the stack before its stores).  The faster by more than :data:`MARGIN` wins, a tie keeps plain stores.
Each verdict is kept in the kernel cache (:data:`PROBE_FILE`) for this machine and thread count.

Each timed run starts with the kernel's arrays out of every cache level (:data:`FLUSH_SOURCE`), each form
writing an output of its own: the state a planned call meets when other work (the rest of the model, the
caller's own) ran since the last one.  Timed back to back instead, the arrays stay in the large cache of the
Intel VM and plain stores looked faster to 32 MiB (RMSNorm 1.25 ms plain, 1.55 ms streaming), while in
``cpu_peers``' interleaved rounds the same RMSNorm kernel ran 2.14 ms with plain stores and 1.52 ms
streaming; from a cold start streaming won there at every size from 4 MiB, also when the time of reading the
output back was counted (the next kernel's loss when its input is not left in the cache).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backends.cpu import parallel
from backends.cpu.buffers import aligned_empty
from backends.cpu.codegen import CKernel, generate
from backends.cpu.compiler import Compiler, cache_dir, keep_record, read_record
from backends.cpu.gemm import fastest_of
from backends.cpu.memory import cache_bytes, cache_levels, streams
from backends.cpu.prelude import SYMBOL
from planner.core.graph import TensorType
from planner.core.machine import cpu_model
from planner.core.plans import Expr, Load

log = logging.getLogger(__name__)

#: streaming must be this much faster (fastest round against fastest round) to be chosen
MARGIN = 0.03
#: timed rounds per size, each timing both forms (after one untimed round)
ROUNDS = 7
#: the kernel cache's record of the verdicts for plans on a number of threads
PROBE_FILE = "streaming-{threads}.json"
#: the kernels measured: a loop over elements (a copy) and a row kernel (an RMSNorm)
KINDS = ("flat", "row")
#: the state each timed run starts from, in the kept record's key (verdicts timed back to back, before, are
#: measured again)
START = "arrays evicted"
#: the row kernel's row length (a multiple of 16, as a streaming row kernel's must be)
ROW_WIDTH = 1024
#: a "kernel" that evicts bytes ``start``..``end`` of an array from every cache level (64-byte lines); off x86
#: there is no streaming form to measure (``codegen`` streams only on AVX targets), and it does nothing
FLUSH_SOURCE = f"""#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
void {SYMBOL}(const char* p, int64_t start, int64_t end, int64_t unused) {{
    (void)unused;
#if defined(__CLFLUSHOPT__)
    /* weakly ordered: many lines in flight at once, the fence waits for them all */
    for (int64_t i = start; i < end; i += 64) _mm_clflushopt(p + i);
    _mm_mfence();
#elif defined(__x86_64__) || defined(__i386__)
    for (int64_t i = start; i < end; i += 64) _mm_clflush(p + i);
    _mm_mfence();
#else
    (void)p; (void)start; (void)end;
#endif
}}
"""


def bucket_of(total_bytes: int) -> int:
    """The power of two at or below ``total_bytes`` (at least 1): the size class one measurement answers for. Not
    the one above: RMSNorm's 32 MiB and its 8 KiB weight are a 32 MiB kernel, not a 64 MiB one."""
    return 1 << max(0, total_bytes.bit_length() - 1)


@dataclass
class StreamProbe:
    """Whether a kernel moving ``total`` bytes (inputs and output) on ``threads`` threads should stream its
    output, on this machine.

    ``floor``: below it plain stores, unmeasured; ``ceiling``: from it streaming, unmeasured; in between, one
    measurement per power of two (:func:`time_kernel` on the caller's pool, kept in the kernel cache; ``measure``:
    a timing of its own, nothing kept)."""

    floor: int
    ceiling: int
    threads: int = 1
    measure: Callable[[int], dict[str, float]] | None = None
    #: (kind, size) -> streams
    verdicts: dict[tuple[str, int], bool] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def pays(self, total: int, kind: str = "flat", pool: parallel.WorkerPool | None = None) -> bool:
        """``kind``: the kernel's, one of :data:`KINDS`; ``pool``: where a measurement runs (the plan's, of
        :attr:`threads` threads), else the calling thread."""
        if total >= self.ceiling:
            return True
        if total < self.floor:
            return False
        size = bucket_of(total)
        with self._lock:
            verdict = self.verdicts.get((kind, size))
            if verdict is None:
                verdict = self.verdicts[kind, size] = self._measure(kind, size, pool)
        return verdict

    def _measure(self, kind: str, size: int, pool: parallel.WorkerPool | None) -> bool:
        t0 = time.perf_counter()
        us = self.measure(size) if self.measure is not None else time_kernel(kind, size, pool)
        verdict = us["stream_us"] < (1.0 - MARGIN) * us["plain_us"]
        log.info("streaming stores for a %s kernel moving %d MiB on %d thread(s): %.0f µs against %.0f µs with plain "
                 "stores: %s (%.2f s)", kind, size >> 20, self.threads, us["stream_us"], us["plain_us"],
                 "streams" if verdict else "plain stores", time.perf_counter() - t0)
        if self.measure is None:
            self._keep(f"{kind}:{size}", verdict, us)
        return verdict

    def _key(self) -> dict[str, Any]:
        return {"cpu": cpu_model(), "cpus": os.cpu_count(), "ceiling": self.ceiling, "floor": self.floor,
                "threads": self.threads, "start": START}

    def _kept(self) -> dict[tuple[str, int], bool]:
        record = read_record(self._path(), self._key())
        sizes = record.get("sizes", {}) if record is not None else {}
        kept = {}
        for name, v in sizes.items():
            kind, _, size = str(name).partition(":")
            if kind in KINDS and size.isdigit() and isinstance(v, dict) and "streams" in v:
                kept[kind, int(size)] = bool(v["streams"])
        return kept

    def _keep(self, name: str, verdict: bool, us: dict[str, float]) -> None:
        record = read_record(self._path(), self._key()) or {"key": self._key(), "sizes": {}}
        record.setdefault("sizes", {})[name] = {"streams": verdict, **{k: round(v, 1) for k, v in us.items()}}
        keep_record(self._path(), record, "the streaming-store measurement")

    def _path(self) -> Path:
        return cache_dir() / PROBE_FILE.format(threads=self.threads)


@functools.cache
def machine_probe(threads: int) -> StreamProbe:
    """This process's probe for plans on ``threads`` threads (every such backend's): the ceiling is the last-level
    cache as reported, the floor twice the level below it (the core's own cache, at least 1 MiB), verdicts
    already kept in the kernel cache read."""
    levels = cache_levels()
    inner = sorted(levels.values())[-2] if len(levels) >= 2 else 0
    probe = StreamProbe(floor=max(2 * inner, 1 << 20), ceiling=cache_bytes()[0], threads=threads)
    probe.verdicts.update(probe._kept())
    return probe


def forget_verdicts() -> int:
    """Drop every kept streaming verdict (all thread counts) and this process's: each size is measured again when a
    plan next needs it (``fusion-planner calibrate --backend cpu``: a verdict measured under a passing load
    should not last).  Returns how many records were removed."""
    removed = 0
    for path in cache_dir().glob(PROBE_FILE.format(threads="*")):
        try:
            path.unlink()
            removed += 1
        except OSError as exc:
            log.warning("cannot remove %s: %s", path, exc)
    machine_probe.cache_clear()
    return removed


def _copy_body(n: int) -> Expr:
    return Expr("Affine", (Load("x"),), (("a", 1.0), ("b", 0.0)), "", TensorType((n,), "fp32"))


def _row_body(rows: int) -> Expr:
    """RMSNorm of ``rows`` rows of :data:`ROW_WIDTH` (x times the rsqrt of its rows' mean square)."""
    def t(cols: int) -> TensorType:
        return TensorType((rows, cols), "fp32")

    ms = Expr("RowMean", (Expr("Square", (Load("x"),), (), "square", t(ROW_WIDTH)),), (), "ms", t(1))
    rstd = Expr("Rsqrt", (Expr("Affine", (ms,), (("a", 1.0), ("b", 1e-6)), "eps", t(1)),), (), "rstd", t(1))
    return Expr("MulRow", (Load("x"), rstd), (), "out", t(ROW_WIDTH))


def time_kernel(kind: str, size: int, pool: parallel.WorkerPool | None = None, compiler: Compiler | None = None
                ) -> dict[str, float]:
    """The fastest of :data:`ROUNDS` interleaved rounds (µs) of a generated fp32 kernel of ``kind`` (a copy, or
    an RMSNorm of rows) moving ``size`` bytes (half read, half written), with streaming and with plain stores,
    split across ``pool`` as the backend splits such a kernel (else on the calling thread), each run started
    with its input and output out of the caches.  Where the compiler does not target AVX there is no streaming
    form: both times are the plain kernel's."""
    rows = max(1, size // (8 * ROW_WIDTH)) if kind == "row" else 1
    n = rows * ROW_WIDTH if kind == "row" else max(16, size // 8)
    x = aligned_empty((n,), np.float32)
    x.fill(1.0)
    outs = {name: aligned_empty((n,), np.float32) for name in ("stream_us", "plain_us")}
    for out in outs.values():  # each form its own output, as each plan has
        out.fill(0.0)  # the pages exist before either form is timed
    compiler = compiler or Compiler()
    compiler.build_many(kernel_sources())
    flush = compiler.function(FLUSH_SOURCE, 1)
    calls, evictions = {}, {}
    for name, ck in _kernels(kind, rows if kind == "row" else n).items():
        fn = compiler.function(ck.source, len(ck.params) + 1)
        out = outs[name]
        calls[name] = _split_rows(fn, x, out, rows, pool) if kind == "row" else _split_call(fn, x, out, pool)
        evictions[name] = _evicting(flush, x, out)
    best = {name: seconds * 1e6 for name, seconds in fastest_of(calls, ROUNDS, before=evictions).items()}
    if not all(np.allclose(out[:16], 1.0) for out in outs.values()):
        raise RuntimeError(f"the streaming probe's {kind} kernel computed a wrong result")
    return best


def _evicting(flush: Any, *arrays: np.ndarray) -> Callable[[], None]:
    """A call that evicts ``arrays`` from the caches."""
    spans = [(a.ctypes.data, a.nbytes) for a in arrays]

    def evict() -> None:
        for address, nbytes in spans:
            flush(address, 0, nbytes, 0)
    return evict


def kernel_sources() -> list[str]:
    """The sources of every kernel the probe times (they do not depend on the size), for one compiler run."""
    return [FLUSH_SOURCE, *(ck.source for kind in KINDS for ck in _kernels(kind, 1).values())]


def _kernels(kind: str, size: int) -> dict[str, CKernel]:
    """The probe's kernel of ``kind`` over ``size`` rows (or elements) with streaming and with plain stores (the
    plain one twice where the compiler does not target AVX). Their sources do not depend on the size: every
    kind's both forms are compiled in one compiler run, the first time any is measured."""
    body, shape = (_row_body(size), (size, ROW_WIDTH)) if kind == "row" else (_copy_body(size), (size,))
    forms = {name: generate(body, {"x": (shape, "fp32")}, stream=stream)
             for name, stream in (("stream_us", True), ("plain_us", False))}
    if not streams(forms["stream_us"].source):
        forms["stream_us"] = forms["plain_us"]
    return forms


def _split_call(fn: Any, x: np.ndarray, out: np.ndarray, pool: parallel.WorkerPool | None) -> Callable[[], None]:
    """``out = copy(x)`` by ``fn`` in the parts a flat elementwise kernel of that many elements runs in."""
    n, xa, oa = x.size, x.ctypes.data, out.ctypes.data
    parts = parallel.loop_parts(pool.threads, n) if pool is not None else 1
    if pool is None or parts == 1:
        return lambda: fn(xa, oa, 0, 1, n)
    ranges = parallel.split(n, parts, parallel.CHUNK_ALIGN)
    args = [[xa + 4 * e0, oa + 4 * e0, 0, 1, e1 - e0] for e0, e1 in ranges]
    return lambda: pool.run_kernel(fn, 2, args)


def _split_rows(fn: Any, x: np.ndarray, out: np.ndarray, rows: int,
                pool: parallel.WorkerPool | None) -> Callable[[], None]:
    """The row kernel ``fn`` over ``rows`` rows of ``x`` into ``out``, its rows split as the backend splits them."""
    xa, oa = x.ctypes.data, out.ctypes.data
    parts = parallel.loop_parts(pool.threads, rows * ROW_WIDTH) if pool is not None else 1
    if pool is None or parts == 1:
        return lambda: fn(xa, oa, 0, rows, ROW_WIDTH)
    args = [[xa, oa, r0, r1, ROW_WIDTH] for r0, r1 in parallel.split(rows, parts)]
    return lambda: pool.run_kernel(fn, 2, args)

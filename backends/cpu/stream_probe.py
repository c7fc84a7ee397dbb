"""Where streaming (non-temporal) stores pay on this machine: measured, not read off the cache size.

A kernel that writes its output with streaming stores sends it to memory without first reading the
destination's lines; one with plain stores keeps it in the cache, where the next call finds it.  Which is faster
depends on how much of the last-level cache a process really has: sysfs under a hypervisor can report the
host's (480 MiB on one Intel VM, where streaming was faster from 16 MiB of traffic), and on an AMD EPYC with a
32 MiB L3 plain stores still won at 25 MiB.  So between twice the next-to-last cache level (below: the arrays
live in caches of the core's own, plain stores) and the last level sysfs reports (from there: streaming), a
kernel's traffic is rounded up to a power of two and, the first time a plan needs that size, a copy kernel is
timed both ways, interleaved, on the plan's threads (split as an elementwise kernel is: on two threads of the
Intel VM RMSNorm's 32 MiB ran 0.68 ms with plain stores and 0.81 streaming, on one thread 2.18 against 1.61);
the faster by more than :data:`MARGIN` wins, a tie keeps plain stores.  Each size's verdict is kept in the
kernel cache (:data:`PROBE_FILE`) for this machine and thread count.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.cpu import parallel
from backends.cpu.buffers import aligned_empty
from backends.cpu.codegen import generate
from backends.cpu.compiler import Compiler, cache_dir, keep_record, read_record
from backends.cpu.memory import cache_bytes, cache_levels, streams
from planner.core.graph import TensorType
from planner.core.machine import cpu_model
from planner.core.plans import Expr, Load

log = logging.getLogger(__name__)

#: streaming must be this much faster (fastest round against fastest round) to be chosen
MARGIN = 0.03
#: timed rounds per size, each timing both forms (after one untimed round)
ROUNDS = 7
PROBE_FILE = "streaming.json"


def bucket_of(total_bytes: int) -> int:
    """The power of two at or above ``total_bytes``: the size class one measurement answers for."""
    return 1 << max(0, total_bytes - 1).bit_length()


@dataclass
class StreamProbe:
    """Whether a kernel moving ``total`` bytes (inputs and output) on ``threads`` threads should stream its
    output, on this machine.

    ``floor``: below it plain stores, unmeasured; ``ceiling``: from it streaming, unmeasured; in between, one
    measurement per power of two (:func:`time_copy` on the caller's pool, kept in the kernel cache; ``measure``:
    a timing of its own, nothing kept)."""

    floor: int
    ceiling: int
    threads: int = 1
    measure: Callable[[int], dict[str, float]] | None = None
    verdicts: dict[int, bool] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


    def pays(self, total: int, pool: parallel.WorkerPool | None = None) -> bool:
        """``pool``: where a measurement runs (the plan's; one of :attr:`threads` threads), else the calling
        thread."""
        if total >= self.ceiling:
            return True
        if total < self.floor:
            return False
        size = bucket_of(total)
        if size >= self.ceiling:
            return True
        with self._lock:
            verdict = self.verdicts.get(size)
            if verdict is None:
                verdict = self.verdicts[size] = self._measure(size, pool)
        return verdict

    def _measure(self, size: int, pool: parallel.WorkerPool | None) -> bool:
        t0 = time.perf_counter()
        us = self.measure(size) if self.measure is not None else time_copy(size, pool)
        verdict = us["stream_us"] < (1.0 - MARGIN) * us["plain_us"]
        log.info("streaming stores at %d MiB of traffic on %d thread(s): %.0f µs against %.0f µs with plain stores: "
                 "%s (%.2f s)", size >> 20, self.threads, us["stream_us"], us["plain_us"],
                 "streams" if verdict else "plain stores", time.perf_counter() - t0)
        if self.measure is None:
            self._keep(size, verdict, us)
        return verdict

    def _key(self) -> dict[str, Any]:
        return {"cpu": cpu_model(), "cpus": os.cpu_count(), "ceiling": self.ceiling, "floor": self.floor,
                "threads": self.threads}

    def _kept(self) -> dict[int, bool]:
        record = read_record(cache_dir() / PROBE_FILE, self._key())
        sizes = record.get("sizes", {}) if record is not None else {}
        return {int(s): bool(v["streams"]) for s, v in sizes.items() if isinstance(v, dict) and "streams" in v}

    def _keep(self, size: int, verdict: bool, us: dict[str, float]) -> None:
        record = read_record(cache_dir() / PROBE_FILE, self._key()) or {"key": self._key(), "sizes": {}}
        record.setdefault("sizes", {})[str(size)] = {"streams": verdict, **{k: round(v, 1) for k, v in us.items()}}
        keep_record(cache_dir() / PROBE_FILE, record, "the streaming-store measurement")


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


def _copy_body(n: int) -> Expr:
    return Expr("Affine", (Load("x"),), (("a", 1.0), ("b", 0.0)), "", TensorType((n,), "fp32"))


def time_copy(size: int, pool: parallel.WorkerPool | None = None, compiler: Compiler | None = None
              ) -> dict[str, float]:
    """The fastest of :data:`ROUNDS` interleaved rounds (µs) of a generated fp32 copy moving ``size`` bytes (half
    read, half written), with streaming and with plain stores, split across ``pool`` as the backend splits a
    flat elementwise kernel (else on the calling thread).  Where the compiler does not target AVX there is no
    streaming form: both times are the plain kernel's."""
    n = max(16, size // 8)
    x = aligned_empty((n,), np.float32)
    x.fill(1.0)
    out = aligned_empty((n,), np.float32)
    out.fill(0.0)  # the pages exist before either form is timed
    compiler = compiler or Compiler()
    body = _copy_body(n)
    calls = {}
    for name, stream in (("stream_us", True), ("plain_us", False)):
        ck = generate(body, {"x": ((n,), "fp32")}, stream=stream)
        if stream and not streams(ck.source):
            ck = generate(body, {"x": ((n,), "fp32")})
        calls[name] = _split_call(compiler.function(ck.source, len(ck.params) + 1), x, out, pool)
    best = dict.fromkeys(calls, float("inf"))
    for r in range(ROUNDS + 1):
        for name, call in calls.items():
            t0 = time.perf_counter_ns()
            call()
            if r:
                best[name] = min(best[name], (time.perf_counter_ns() - t0) / 1e3)
    if not np.array_equal(out[:16], x[:16]):
        raise RuntimeError("the streaming probe's copy kernel computed a wrong result")
    return best


def _split_call(fn: Any, x: np.ndarray, out: np.ndarray, pool: parallel.WorkerPool | None) -> Callable[[], None]:
    """``out = copy(x)`` by ``fn`` in the parts a flat elementwise kernel of that many elements runs in."""
    n, xa, oa = x.size, x.ctypes.data, out.ctypes.data
    parts = parallel.loop_parts(pool.threads, n) if pool is not None else 1
    if pool is None or parts == 1:
        return lambda: fn(xa, oa, 0, 1, n)
    ranges = parallel.split(n, parts, parallel.CHUNK_ALIGN)
    args = [[xa + 4 * e0, oa + 4 * e0, 0, 1, e1 - e0] for e0, e1 in ranges]
    return lambda: pool.run_kernel(fn, 2, args)

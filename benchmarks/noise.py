"""A noisy neighbour on demand: another process streaming memory on another core, as a busy shared machine has.

``with neighbour(busy_core): ...`` starts a child pinned to ``busy_core`` that copies two arrays of 4x the
last-level cache back and forth until the block ends (it competes for the memory bus and the shared cache,
not for the measured core).  ``pick_cores()`` chooses the measured core and the neighbour's from the affinity
mask.  Used by ``cpu_peers.py --noise`` and ``plan_stability.py --noise``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

from backends.cpu.memory import cache_bytes

_STREAMER = """
import os, sys
import numpy as np
os.sched_setaffinity(0, {int(sys.argv[1])})
n = int(sys.argv[2]) // 4
a = np.ones(n, np.float32)
b = np.empty_like(a)
print("ready", flush=True)
while True:
    np.copyto(b, a)
    np.copyto(a, b)
"""


def pick_cores() -> tuple[int, int | None]:
    """(the measured core, the neighbour's core or None on a one-core mask)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[-1], (cores[0] if len(cores) > 1 else None)


@contextlib.contextmanager
def neighbour(core: int | None, factor: int = 4) -> Iterator[str]:
    """A memory-streaming process on ``core`` for the block (nothing when ``core`` is None); yields a line that
    says what ran, for the report."""
    if core is None:
        yield "no neighbour (one core in the affinity mask)"
        return
    size = factor * cache_bytes()[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _STREAMER, str(core), str(size)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the noise neighbour did not start")
        time.sleep(0.2)  # its arrays are touched and it is streaming
        yield f"a neighbour process streaming {2 * size / 2**20:.0f} MiB (two arrays of {factor}x the last-level cache) on core {core}"
    finally:
        proc.kill()
        proc.wait()

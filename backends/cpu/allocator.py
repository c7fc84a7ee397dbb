"""glibc's malloc thresholds, fixed once for a process that runs planned calls.

glibc serves a request of 128 KiB or more (``M_MMAP_THRESHOLD``) with a fresh ``mmap`` and gives the top of its
heap back to the system once more than 128 KiB of it is free (``M_TRIM_THRESHOLD``).  Both rise on their own
when the process frees a large mapped block (up to 32 MiB and 64 MiB): a process that planned cold (the
calibration's and the search's big arrays) ends with high thresholds, one that loaded its plan from the caches
keeps the defaults.  There every call's megabyte-sized tensors (eager torch's intermediates, torch's own
outputs, the inputs and outputs around a planned call) are mapped or taken from a heap top just given back, and
faulted in page by page again: eager torch ran MobileNetV2's inverted residual 3-6x slower there, and the planned
call 1.5x slower (``docs/backends.md``, "Memory").

:func:`keep_freed_memory` fixes them where the process has not chosen otherwise: requests below
:data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` of free heap top is kept.  It is
process-wide (every library's allocations), done when a CPU backend is made, and left undone when
``FUSION_PLANNER_MALLOC=glibc``, when the environment already sets a ``MALLOC_*_`` variable or a
``glibc.malloc`` tunable, or when the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

from planner.core.env import env_choice

log = logging.getLogger(__name__)

ENV = "FUSION_PLANNER_MALLOC"
#: the largest mmap threshold glibc's own adjustment reaches on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``)
MMAP_THRESHOLD = 32 * 1024 * 1024
#: free heap top kept before it is given back: four times the largest request the heap serves
TRIM_THRESHOLD = 4 * MMAP_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_done: str | None = None


def reason_to_leave(choice: str, environ: Mapping[str, str], libc: str) -> str | None:
    """Why the thresholds stay as they are (None: set them): ``choice`` (``$FUSION_PLANNER_MALLOC``: keep or
    glibc), glibc's own variables or tunables in ``environ``, or a C library ``libc`` other than glibc."""
    if choice == "glibc":
        return f"{ENV}=glibc"
    chosen = [v for v in _GLIBC_VARIABLES if v in environ]
    if chosen:
        return f"{chosen[0]} is set"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    if libc != "glibc":
        return f"the C library is {libc or 'unknown'}, not glibc"
    return None


def keep_freed_memory() -> str:
    """Fix glibc's mmap and trim thresholds once for this process (see the module's text); what was done."""
    global _done
    if _done is None:
        why = reason_to_leave(env_choice(ENV, ("keep", "glibc"), "keep"), os.environ, platform.libc_ver()[0])
        if why is not None:
            _done = f"malloc thresholds left as they are ({why})"
        else:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            _done = (f"malloc thresholds fixed: mmap {MMAP_THRESHOLD >> 20} MiB, trim {TRIM_THRESHOLD >> 20} MiB"
                     if ok else "malloc thresholds left as they are (glibc's mallopt refused them)")
        log.info(_done)
    return _done

"""glibc's malloc thresholds: fixed when a CPU backend is made, unless the user or the C library says otherwise."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from testpaths import ROOT

from backends.cpu import allocator
from backends.cpu.allocator import ENV, reason_to_leave
from planner.core.errors import UsageError

#: where an 8 MiB malloc lands in a fresh process, then a 16 MiB one once the planner's setting was asked for: on the
#: heap (the process's [heap] mapping) or mapped on its own. The process first fixes the threshold at 1 MiB itself, so
#: that what its imports allocate and free cannot raise it (glibc raises it to each mapped block freed)
_WHERE_MIBS_LAND = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
assert libc.mallopt(-3, 1 << 20) == 1  # M_MMAP_THRESHOLD
from backends.cpu import allocator
def on_heap(mib):
    p = libc.malloc(mib << 20)
    heap = next(line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
    low, high = (int(a, 16) for a in heap.split("-"))
    libc.free(p)
    return low <= p < high
before = on_heap(8)
done = allocator.keep_freed_memory()
print(before, on_heap(16), done, sep="|")
"""


def where_mibs_land(**env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != ENV} | env
    out = subprocess.run([sys.executable, "-c", _WHERE_MIBS_LAND], cwd=ROOT, env=environ, capture_output=True,
                         text=True, check=True, timeout=60)
    return out.stdout.strip().split("|")


glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


@glibc_only
def test_a_megabyte_request_comes_from_the_heap_once_the_thresholds_are_fixed() -> None:
    before, after, done = where_mibs_land()
    assert (before, after) == ("False", "True"), done
    assert done.startswith("malloc thresholds fixed")


@glibc_only
def test_the_user_can_leave_glibc_as_it_is() -> None:
    before, after, done = where_mibs_land(**{ENV: "glibc"})
    assert (before, after) == ("False", "False")
    assert f"{ENV}=glibc" in done


def test_glibc_variables_and_tunables_of_the_user_win() -> None:
    assert reason_to_leave("keep", {"MALLOC_TRIM_THRESHOLD_": "0"}, "glibc") == "MALLOC_TRIM_THRESHOLD_ is set"
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}
    assert reason_to_leave("keep", tunables, "glibc") == "GLIBC_TUNABLES sets glibc.malloc"
    assert reason_to_leave("keep", {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, "glibc") is None


def test_only_glibc_is_told() -> None:
    assert reason_to_leave("keep", {}, "") == "the C library is unknown, not glibc"
    assert reason_to_leave("keep", {}, "glibc") is None
    assert reason_to_leave("glibc", {}, "glibc") == f"{ENV}=glibc"


def test_a_bad_choice_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "tcmalloc")
    monkeypatch.setattr(allocator, "_done", None)
    with pytest.raises(UsageError, match=ENV):
        allocator.keep_freed_memory()

"""glibc's malloc thresholds: fixed when a CPU backend is made, unless the user or the C library says otherwise."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from backends.cpu import allocator
from backends.cpu.allocator import ENV, reason_to_leave
from planner.core.errors import UsageError
from tests.testpaths import ROOT

#: where an 8 MiB malloc lands in a fresh process, then (its free having raised glibc's own threshold to 8 MiB) a
#: 16 MiB one: on the heap (below the program break) or mapped on its own
_WHERE_MIBS_LAND = """
import ctypes, sys
from backends.cpu import allocator
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_void_p], [ctypes.c_long]
def on_heap(mib):
    p = libc.malloc(mib << 20)
    heap = p < libc.sbrk(0)
    libc.free(p)
    return heap
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

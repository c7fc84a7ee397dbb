"""Reading an input file: a graph, plan, bundle, measured, device, rule file or a plan-cache entry.

Only a regular file is read, opened without blocking (a FIFO in its place, or ``--graph /dev/zero``, is
refused, never waited on), up to a size limit; a larger file is refused, naming the file and the limit,
before it is parsed. JSON is parsed by :func:`read_json`, which refuses, naming the file, what Python's
parser would raise in any of several ways: nesting too deep, an integer of thousands of digits, a number
that overflows a float, NaN or Infinity.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from planner.core import limits

#: the largest integer a JSON file may hold: far beyond any shape, seed or attribute the planner takes
MAX_JSON_INT_DIGITS = 30


def read_limited(path: str | Path, error: type[Exception], what: str = "file", limit: int | None = None) -> str:
    """The UTF-8 text of ``path``; ``error`` (naming the file) when it is missing, unreadable, not UTF-8
    or larger than ``limit`` bytes (default: the input-file limit in force, ``core.limits``)."""
    p = Path(path)
    cap = limits.current().file_bytes if limit is None else limit
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{what} not found: {p}") from None
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{p}: not a regular file (a {what} is read from a regular file only)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = _read_up_to(f, cap + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > cap:
        flag = f" ({limits.flag_of('file_bytes')})" if limit is None else ""
        raise error(f"{p}: larger than {cap:,} bytes, the limit for a {what}{flag}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{p}: not UTF-8 text (byte {exc.start})") from None


def _read_up_to(f: BinaryIO, n: int) -> bytes:
    """At most ``n`` bytes, a MiB at a time: ``f.read(n)`` allocates all ``n`` first (a limit of 100 GB raised
    MemoryError on a 1 KB file)."""
    chunks: list[bytes] = []
    total = 0
    while total < n:
        chunk = f.read(min(1 << 20, n - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def untrusted_dir(path: str | Path) -> str:
    """Why a cache folder must not be trusted ("" when it may): owned by another user, or writable by
    others (whoever can write there can replace what is loaded from it)."""
    try:
        st = Path(path).stat()
    except OSError:
        return ""  # not there yet: whatever creates it creates it as this user
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"others may write to it (mode {st.st_mode & 0o777:o}); chmod go-w it to use it"
    return ""


def parse_json(text: str, error: type[Exception], where: str) -> Any:
    """JSON text as Python values; ``error`` naming ``where`` for malformed JSON, nesting deeper than Python's
    parser goes, an integer of more than :data:`MAX_JSON_INT_DIGITS` digits, or a number that is not a finite
    float (``1e400``, ``NaN``, ``Infinity``)."""

    def integer(s: str) -> int:
        if len(s.lstrip("-")) > MAX_JSON_INT_DIGITS:
            raise error(f"{where}: an integer of {len(s.lstrip('-')):,} digits (at most {MAX_JSON_INT_DIGITS})")
        return int(s)

    def real(s: str) -> float:
        x = float(s)
        if not math.isfinite(x):
            raise error(f"{where}: the number {s[:40]} is not a finite float")
        return x

    def constant(s: str) -> Any:
        raise error(f"{where}: {s} is not JSON (a file holds finite numbers only)")

    try:
        return json.loads(text, parse_int=integer, parse_float=real, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deep to read") from None


def read_json(path: str | Path, error: type[Exception], what: str = "file", limit: int | None = None) -> Any:
    """A JSON input file's value, read by :func:`read_limited` and parsed by :func:`parse_json`."""
    return parse_json(read_limited(path, error, what, limit), error, f"{what} {Path(path)}")

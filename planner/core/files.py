"""Reading an input file with a size limit: a graph, plan, bundle, measured, device or rule file.

``--graph /dev/zero`` must not read for ever: a file larger than the limit (or a device that
never ends) is refused, naming the file and the limit, before it is parsed.
"""

from __future__ import annotations

import os
from pathlib import Path

from planner.core import limits


def read_limited(path: str | Path, error: type[Exception], what: str = "file", limit: int | None = None) -> str:
    """The UTF-8 text of ``path``; ``error`` (naming the file) when it is missing, unreadable, not UTF-8
    or larger than ``limit`` bytes (default: the input-file limit in force, ``core.limits``)."""
    p = Path(path)
    cap = limits.current().file_bytes if limit is None else limit
    try:
        with p.open("rb") as f:
            data = f.read(cap + 1)
    except FileNotFoundError:
        raise error(f"{what} not found: {p}") from None
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    if len(data) > cap:
        flag = f" ({limits.flag_of('file_bytes')})" if limit is None else ""
        raise error(f"{p}: larger than {cap:,} bytes, the limit for a {what}{flag}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{p}: not UTF-8 text (byte {exc.start})") from None


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

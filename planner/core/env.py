"""Settings read from environment variables, each parsed with a message naming the variable: a bad value is a
usage error (the CLI exits 2), never a traceback at import."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from planner.core.errors import UsageError


def env_seconds(name: str, default: float) -> float:
    """A positive, finite number of seconds in ``$name`` (unset or empty: ``default``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"${name} must be a number of seconds, got {raw[:40]!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"${name} must be a positive number of seconds, got {raw[:40]!r}")
    return value


def env_count(name: str) -> int | None:
    """The non-negative integer in ``$name``; None when it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise UsageError(f"${name} must be an integer, got {raw[:40]!r}") from None
    if n < 0:
        raise UsageError(f"${name} must be >= 0, got {n}")
    return n


def env_choice(name: str, choices: Sequence[str], default: str, given: str | None = None) -> str:
    """``given`` if not None, else ``$name`` (unset or empty: ``default``), one of ``choices``."""
    value = (given or os.environ.get(name) or default).strip().lower()
    if value not in choices:
        raise UsageError(f"${name}={value[:40]!r}: expected {', '.join(choices)}")
    return value

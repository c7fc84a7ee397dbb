"""The error of a bad option value, shared by every layer (the CLI reports it and exits 2)."""

from __future__ import annotations


class UsageError(ValueError):
    """A command-line value or API option is out of range or inconsistent."""

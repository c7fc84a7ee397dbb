"""The errors of bad input shared by every layer (the CLI reports them and exits 2)."""

from __future__ import annotations


class UsageError(ValueError):
    """A command-line value or API option is out of range or inconsistent."""


class OpError(ValueError):
    """An op was used with the wrong inputs, attributes, dtypes or shapes."""

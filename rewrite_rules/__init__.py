"""The shipped rewrite rules: hand-written egglog rule files, and nothing else.

Each file holds only rule commands, each rule under one comment line saying why it is sound
(docs/rules.md). The mechanical rules are not here: ``planner.rules.rulegen`` generates them from
the op table, and ``planner.rules.files`` interleaves both in declaration order. This package
imports nothing of the planner or a backend (an import-linter contract holds it to that).
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable


def rule_files() -> list[str]:
    """The names of the shipped rule files."""
    return sorted(f.name for f in resources.files(__name__).iterdir() if f.name.endswith(".egg"))


def rule_file(name: str) -> Traversable:
    """One shipped rule file (``algebra.egg``, ...); a name that is not shipped raises ``FileNotFoundError``."""
    if name not in rule_files():
        raise FileNotFoundError(f"no shipped rule file {name!r}; shipped: {', '.join(rule_files())}")
    return resources.files(__name__) / name


__all__ = ["rule_file", "rule_files"]

"""The rules a planning run uses: the shipped ones plus user rule files, each checked sound first."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from planner.rules.files import RuleFile, parse_rule_text, read_rule_file, shipped_rules


def user_rules(paths: Iterable[str | Path], *, check: bool = True) -> list[RuleFile]:
    """User rule files: only rule commands, and (``check``) every rule found sound by
    :mod:`planner.rules.check`; an unsound rule raises ``UnsoundRuleError`` naming it."""
    out = []
    for p in paths:
        text = read_rule_file(p)
        parse_rule_text(text, str(p), shipped=False)
        if check:
            # the checker imports hypothesis, a tenth of a second of every planning process's start (a CLI
            # run's, a cluster worker's): loaded only where a user rule file is given
            from planner.rules.check import refuse_unsound

            refuse_unsound(str(p), text)
        out.append(RuleFile(str(p), text, False))
    return out


def load_rules(paths: Sequence[str | Path] = ()) -> list[RuleFile]:
    """Shipped rules plus user rule files (checked to hold only rule commands, and sound)."""
    return shipped_rules() + user_rules(paths)


def rules_hash(rules: Sequence[RuleFile]) -> str:
    """A short hash of a rule set's texts, in order (part of every plan-cache key)."""
    h = hashlib.sha256()
    for rf in rules:
        h.update(rf.text.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]

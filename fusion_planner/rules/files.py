"""Rule files: egglog text with rule commands only, parsed by egglog's own parser.

The shipped rules are the hand-written files in ``shipped/`` and the texts generated from
the op table (``rulegen``), in declaration order. User rule files may hold only rule
commands; :mod:`fusion_planner.rules.load` also checks them sound before use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from egglog import bindings

from fusion_planner.core.files import read_limited
from fusion_planner.rules.rulegen import generated_text

RULES_DIR = Path(__file__).resolve().parent / "shipped"
#: shipped rules in declaration order: hand-written files and ``generated:<ruleset>`` texts from the op table
SHIPPED_RULE_FILES = ("limits.egg", "generated:limits", "generated:elementwise", "algebra.egg", "attention.egg",
                      "generated:epilogue", "cublaslt.egg")


#: the rulesets the planner schedules itself: the analysis and limits facts run to saturation before every
#: step, so a user rule there would escape the iteration, node and time limits; the shipped stages are
#: closed too, so that a user file cannot change what the shipped rules mean
PLANNER_RULESETS = ("analysis", "limits", "elementwise", "epilogue", "cublaslt")


class RuleFileError(ValueError):
    """A rule file does not parse or holds commands a rule file may not."""


@dataclass(frozen=True)
class RuleFile:
    path: str
    text: str
    shipped: bool


_USER_ALLOWED = {"RewriteCommand", "BiRewriteCommand", "RuleCommand", "AddRuleset"}
_SHIPPED_ALLOWED = _USER_ALLOWED | {"Datatype", "Datatypes", "Constructor", "Relation", "Sort", "FunctionCommand"}


def parse_rule_text(text: str, path: str, *, shipped: bool) -> list[Any]:
    """Parse with egglog's own parser; refuse commands a rule file may not hold."""

    try:
        cmds = bindings.EGraph().parse_program(text)
    except Exception as exc:  # egglog raises EggSmolError
        msg = " ".join(str(exc).split())
        m = re.search(r"In (\d+):(\d+)", msg)
        where = f"{path}:{m.group(1)}" if m else path
        raise RuleFileError(f"{where}: does not parse: {msg}") from None
    allowed = _SHIPPED_ALLOWED if shipped else _USER_ALLOWED
    for cmd in cmds:
        name = type(cmd).__name__
        if name not in allowed:
            line, keyword = _where(text, cmd)
            raise RuleFileError(
                f"{path}:{line}: a {'shipped' if shipped else 'user'} rule file may hold only "
                f"rewrite, birewrite, rule and ruleset commands; found ({keyword} …)"
            )
        if not shipped and _ruleset_of(cmd) in PLANNER_RULESETS:
            line, _ = _where(text, cmd)
            raise RuleFileError(
                f"{path}:{line}: ruleset {_ruleset_of(cmd)!r} is the planner's own; user rules run in rulesets "
                f"of their own (or the default one), under the saturation limits (closed: {', '.join(PLANNER_RULESETS)})"
            )
    return cmds


def _ruleset_of(cmd: Any) -> str | None:
    """The ruleset a rule command adds to, or a ruleset declaration's name."""
    kind = type(cmd).__name__
    if kind in ("RewriteCommand", "BiRewriteCommand", "AddRuleset"):
        return str(cmd.name)
    if kind == "RuleCommand":
        return str(cmd.rule.ruleset)
    return None


def _where(text: str, cmd: Any) -> tuple[int, str]:
    """Line and keyword of a parsed command, from egglog's source span where it has one."""
    span = getattr(cmd, "span", None)
    for attr in ("schedule", "rule", "rewrite"):
        span = span or getattr(getattr(cmd, attr, None), "span", None)
    data = text.encode()
    if span is not None:
        m = re.match(rb"\(\s*([^\s()]+)", data[span.i :])
        return data.count(b"\n", 0, span.i) + 1, m.group(1).decode() if m else str(cmd).split()[0].lstrip("(")
    head = str(cmd).split()[0].lstrip("(") if str(cmd).split() else str(cmd)
    for i, line in enumerate(text.splitlines(), 1):  # spanless commands (push): first line opening with it
        if re.match(rf"\s*\(\s*{re.escape(head)}\b", line):
            return i, head
    return 1, head


def shipped_rules() -> list[RuleFile]:
    """The hand-written rule files and the rules generated from the op table (fusion_planner/rules/rulegen.py)."""
    out = []
    for f in SHIPPED_RULE_FILES:
        if f.startswith("generated:"):
            out.append(RuleFile(f, generated_text(f.removeprefix("generated:")), True))
        else:
            out.append(RuleFile(str(RULES_DIR / f), (RULES_DIR / f).read_text(), True))
    return out


def read_rule_file(path: str | Path) -> str:
    """A rule file's text; unreadable or non-UTF-8 files are a RuleFileError naming the file."""
    return read_limited(path, RuleFileError, "rule file", limit=16 * 2**20)

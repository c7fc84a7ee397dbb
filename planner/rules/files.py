"""Rule files: egglog text with rule commands only, parsed by egglog's own parser.

The shipped rules are the hand-written files of the ``rewrite_rules`` package and the texts generated from
the op table (``rulegen``), in declaration order. User rule files may hold only rule
commands; :mod:`planner.rules.load` also checks them sound before use.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from egglog import bindings

import rewrite_rules
from planner.core.files import read_limited
from planner.rules.rulegen import generated_text

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


#: nesting depth of a rule file's terms (egglog's parser recurses: a term 20,000 deep crashed the process)
MAX_RULE_DEPTH = 64
#: rules in one user rule file (each is checked sound before use; egglog parses a long program in time
#: and memory that grow with the square of its length: 2,000 one-line rules took 2.3 GB)
MAX_USER_RULES = 1000
#: top-level commands parsed and run together (one egglog program per run keeps both linear)
FORMS_PER_PROGRAM = 32

_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|;[^\n]*|[()]|[^\s()";]+')


@dataclass(frozen=True)
class Form:
    line: int  # where the command opens
    text: str


def split_forms(text: str, path: str) -> list[Form]:
    """The top-level commands of a rule file, refusing unbalanced parentheses and terms nested deeper than
    ``MAX_RULE_DEPTH``, before egglog's parser sees them."""
    forms: list[Form] = []
    depth, start, line, start_line = 0, -1, 1, 1
    pos = 0
    for m in _TOKEN.finditer(text):
        line += text.count("\n", pos, m.start())
        pos = m.start()
        tok = m.group()
        if tok.startswith(";"):
            continue
        if tok == "(":
            if depth == 0:
                start, start_line = m.start(), line
            depth += 1
            if depth > MAX_RULE_DEPTH:
                raise RuleFileError(f"{path}:{line}: terms nest deeper than {MAX_RULE_DEPTH} levels, the limit for a rule file")
        elif tok == ")":
            depth -= 1
            if depth < 0:
                raise RuleFileError(f"{path}:{line}: a ')' closes nothing")
            if depth == 0:
                forms.append(Form(start_line, text[start : m.end()]))
        elif depth == 0:
            forms.append(Form(line, tok))  # a stray atom: egglog's parser names the problem
    if depth:
        raise RuleFileError(f"{path}:{start_line}: a '(' is never closed")
    return forms


def parse_rule_text(text: str, path: str, *, shipped: bool) -> list[Any]:
    """Parse with egglog's own parser; refuse commands a rule file may not hold."""
    return [cmd for _, cmd in parse_rule_forms(text, path, shipped=shipped)]


def parse_rule_forms(text: str, path: str, *, shipped: bool) -> list[tuple[int, Any]]:
    """(line, egglog command) of each command of a rule file, parsed one program of a few commands at a time
    (see ``FORMS_PER_PROGRAM``); refuses commands a rule file may not hold, too deep terms and, in a user
    file, more than ``MAX_USER_RULES`` rules."""
    forms = split_forms(text, path)
    if not shipped:
        n = sum(1 for f in forms if re.match(r"\(\s*(?:rewrite|birewrite|rule)\b", f.text))
        if n > MAX_USER_RULES:
            raise RuleFileError(f"{path}: {n:,} rules; a user rule file holds at most {MAX_USER_RULES:,}")
    cmds: list[tuple[int, Any]] = []
    parser = bindings.EGraph()
    for form in forms:
        try:
            parsed = parser.parse_program(form.text)
        except Exception as exc:  # egglog raises EggSmolError
            msg = " ".join(str(exc).split())
            m = re.search(r"In (\d+):(\d+)", msg)
            where = f"{path}:{form.line + int(m.group(1)) - 1}" if m else f"{path}:{form.line}"
            raise RuleFileError(f"{where}: does not parse: {msg}") from None
        m = re.match(r"\(\s*([^\s()]+)", form.text)
        for cmd in parsed:
            _refuse_forbidden(cmd, form.line, m.group(1) if m else form.text[:20], path, shipped)
            cmds.append((form.line, cmd))
    return cmds


@functools.lru_cache(maxsize=64)
def programs(text: str, path: str) -> tuple[str, ...]:
    """A rule file's text as a few programs of ``FORMS_PER_PROGRAM`` commands each, for egglog to run."""
    forms = [f.text for f in split_forms(text, path)]
    return tuple("\n".join(forms[i : i + FORMS_PER_PROGRAM]) for i in range(0, len(forms), FORMS_PER_PROGRAM))


def _refuse_forbidden(cmd: Any, line: int, keyword: str, path: str, shipped: bool) -> None:
    allowed = _SHIPPED_ALLOWED if shipped else _USER_ALLOWED
    if type(cmd).__name__ not in allowed:
        raise RuleFileError(
            f"{path}:{line}: a {'shipped' if shipped else 'user'} rule file may hold only "
            f"rewrite, birewrite, rule and ruleset commands; found ({keyword} …)"
        )
    if not shipped and _ruleset_of(cmd) in PLANNER_RULESETS:
        raise RuleFileError(
            f"{path}:{line}: ruleset {_ruleset_of(cmd)!r} is the planner's own; user rules run in rulesets "
            f"of their own (or the default one), under the saturation limits (closed: {', '.join(PLANNER_RULESETS)})"
        )


def _ruleset_of(cmd: Any) -> str | None:
    """The ruleset a rule command adds to, or a ruleset declaration's name."""
    kind = type(cmd).__name__
    if kind in ("RewriteCommand", "BiRewriteCommand", "AddRuleset"):
        return str(cmd.name)
    if kind == "RuleCommand":
        return str(cmd.rule.ruleset)
    return None


def shipped_rules() -> list[RuleFile]:
    """The hand-written rule files and the rules generated from the op table (planner/rules/rulegen.py)."""
    out = []
    for f in SHIPPED_RULE_FILES:
        if f.startswith("generated:"):
            out.append(RuleFile(f, generated_text(f.removeprefix("generated:")), True))
        else:
            source = rewrite_rules.rule_file(f)
            out.append(RuleFile(str(source), source.read_text(), True))
    return out


def read_rule_file(path: str | Path) -> str:
    """A rule file's text; unreadable or non-UTF-8 files are a RuleFileError naming the file."""
    return read_limited(path, RuleFileError, "rule file", limit=16 * 2**20)

"""The README's samples run as printed: its Python snippet end to end, and its tour's commands parse."""

from __future__ import annotations

import re
import shlex

import pytest
from testpaths import ROOT

from planner.cli import build_parser

README = (ROOT / "README.md").read_text()


def _fenced(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_the_python_snippet_runs_as_printed(capsys):
    pytest.importorskip("torch")
    (snippet,) = _fenced("python")
    namespace: dict[str, object] = {}
    exec(compile(snippet, "README.md", "exec"), namespace)  # noqa: S102 - the project's own README
    table = capsys.readouterr().out
    assert "plan" in table and "bytes" in table and len(table.splitlines()) >= 3
    y, x = namespace["y"], namespace["x"]
    assert tuple(y.shape) == tuple(x.shape)  # type: ignore[attr-defined]


def test_every_tour_command_parses():
    tour = README.split("## A short tour", 1)[1].split("```", 2)[1]
    commands = [line.split("#", 1)[0].strip() for line in tour.splitlines() if line.startswith("fusion-planner")]
    assert len(commands) >= 4
    parser = build_parser()
    for command in commands:
        parser.parse_args(shlex.split(command)[1:])

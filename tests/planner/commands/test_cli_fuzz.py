"""A fuzz of the command line: every value-taking flag of ``explain``, of ``plan`` (those it adds) and of ``plot``
given hostile values exits 0 or 2, with no traceback (it found an example built until memory ran out and a file
limit allocated before reading)."""

from __future__ import annotations

import argparse

import pytest

from planner.cli import build_parser, main

EXPLAIN = ["explain", "--example", "ew-chain", "--k", "2", "--n", "64"]
PLAN = ["plan", "--example", "ew-chain", "--k", "2", "--n", "64", "--backend", "model", "--max-candidates", "2",
        "--no-cache"]
HOSTILE = ("abc", "-1", "99999999999")
SKIP = {"--torch"}  # a model file is Python the user runs; its failures have their own test


def _value_flags(command: str, besides: str | None = None) -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))

    def flags(name: str) -> list[str]:
        return [a.option_strings[-1] for a in sub.choices[name]._actions
                if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._HelpAction)
                and a.option_strings[-1] not in SKIP]

    shared = set(flags(besides)) if besides else set()
    return [f for f in flags(command) if f not in shared]


def _exits_0_or_2_in_one_line(argv: list[str], capsys) -> None:
    try:
        rc = main(argv)
        parsed = True
    except SystemExit as exc:  # refused by argparse itself: its usage, then one error line
        rc, parsed = exc.code, False
    err = capsys.readouterr().err
    assert rc in (0, 2), (argv, rc, err[-300:])
    assert "Traceback" not in err, argv
    if rc == 2:
        lines = err.strip().splitlines()
        assert "error:" in lines[-1] and (len(lines) == 1 or not parsed), (argv, err[-300:])


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A private plan cache and working folder: a hostile --out or -o value is a folder name too."""
    monkeypatch.setenv("FUSION_PLANNER_PLAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("flag", _value_flags("explain"))
def test_a_hostile_explain_value_exits_0_or_2_in_one_line(flag: str, capsys, scratch) -> None:
    for value in HOSTILE:
        _exits_0_or_2_in_one_line(["explain", flag, value] if flag == "--example" else [*EXPLAIN, flag, value], capsys)


@pytest.mark.parametrize("flag", _value_flags("plan", besides="explain"))
def test_a_hostile_plan_value_exits_0_or_2_in_one_line(flag: str, capsys, scratch) -> None:
    for value in HOSTILE:
        _exits_0_or_2_in_one_line([*PLAN, flag, value], capsys)


@pytest.mark.parametrize("value", [*HOSTILE, "", "{}", "[]", '{"graph": 1}', '{"a": {"candidates": 3}}', "\u0000"])
def test_a_hostile_results_file_exits_2_in_one_line(value: str, capsys, scratch) -> None:
    (scratch / "results.json").write_text(value)
    for argv in (["plot", "results.json"], ["plot", "results.json", "--format", "gif"], ["plot", "nope.json"]):
        _exits_0_or_2_in_one_line(argv, capsys)

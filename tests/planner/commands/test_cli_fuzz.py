"""A fuzz of the command line: every value-taking flag of ``explain`` given hostile values exits 0 or 2, with no
traceback (it found an example built until memory ran out and a file limit allocated before reading)."""

from __future__ import annotations

import argparse

import pytest

from planner.cli import build_parser, main

BASE = ["explain", "--example", "ew-chain", "--k", "2", "--n", "64"]
HOSTILE = ("abc", "-1", "99999999999")
SKIP = {"--torch"}  # a model file is Python the user runs; its failures have their own test


def _value_flags(command: str) -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a.option_strings[-1] for a in sub.choices[command]._actions
            if a.option_strings and a.nargs != 0 and not isinstance(a, argparse._HelpAction)
            and a.option_strings[-1] not in SKIP]


@pytest.mark.parametrize("flag", _value_flags("explain"))
def test_a_hostile_value_exits_0_or_2_in_one_line(flag: str, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FUSION_PLANNER_PLAN_CACHE", str(tmp_path))
    for value in HOSTILE:
        argv = ["explain", flag, value] if flag == "--example" else [*BASE, flag, value]
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

"""``fusion-planner check-rules``: is every rewrite rule sound?"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import TYPE_CHECKING

from planner.commands.common import emit_json, seed_arg
from planner.core.errors import UsageError
from planner.egraph.candidates import planner_problem
from planner.rules.files import RuleFile, read_rule_file, split_forms
from planner.rules.terms import DEFAULT_EXAMPLES

if TYPE_CHECKING:
    from planner.rules.check import RuleResult


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check-rules",
        help="check rewrite rules for soundness on random tensors",
        description=(
            "Instantiate every rule of the given rule files (default: the shipped rules) with random "
            "tensors of op-table-consistent shapes and compare both sides, exactly (fp64) and as a "
            "device computes them (fp32 registers, stores rounded to fp16/bf16/fp32). "
            "Exit 0 when all rules are sound, 1 when any is not, 2 when a file does not parse."
        ),
    )
    p.add_argument("files", nargs="*", metavar="FILE.egg", help="rule files (default: the shipped rules)")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES, help="random cases per rule")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed for the random cases")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.examples < 1:
        raise UsageError("--examples must be at least 1")
    # the checker imports hypothesis, a tenth of a second of every CLI start: loaded when this command runs
    from planner.rules.check import check_files, verdict_counts

    results = check_files(args.files, examples=args.examples, seed=args.seed)
    results = _through_the_planner(args.files, results)
    counts = verdict_counts(results)
    status = 0 if all(r.ok for r in results) else 1
    if args.json:
        emit_json({"seed": args.seed, "examples": args.examples, "counts": counts, "rules": [r.to_json() for r in results]})
        return status
    for r in results:
        print(_line(r))
    summary = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
    print(f"{len(results)} rule{'' if len(results) == 1 else 's'}" + (f": {summary}" if summary else " (the files hold no rules)"))
    return status


def _through_the_planner(paths: list[str], results: list[RuleResult]) -> list[RuleResult]:
    """A user file whose rules are all sound is planned with on the small built-in graphs; when that fails,
    each of its rules alone is, and those that fail are not sound for the planner's purposes."""
    out = list(results)
    for path in paths:
        mine = [i for i, r in enumerate(out) if r.rule.path == str(path)]
        if not mine or not all(out[i].ok for i in mine):
            continue
        text = read_rule_file(path)
        if planner_problem(RuleFile(str(path), text, False)) is None:
            continue
        declarations = "\n".join(f.text for f in split_forms(text, str(path)) if re.match(r"\(\s*ruleset\b", f.text))
        for i in mine:
            alone = RuleFile(str(path), f"{declarations}\n{out[i].rule.text}\n", False)
            problem = planner_problem(alone)
            if problem is not None:
                out[i] = dataclasses.replace(out[i], verdict="unsupported", detail=f"sound, but {problem}",
                                             counterexample=None)
    return out


def _line(r: RuleResult) -> str:
    head = f"{r.rule.label}: {r.verdict}"
    if r.verdict == "sound":
        what = f"{r.cases} cases" if r.cases else "no cases needed"
        extra = f"; {r.detail}" if r.detail else ""
        return f"{head} ({what}{extra})  {r.rule.text}"
    return f"{head}  {r.rule.text}\n    {r.detail}"

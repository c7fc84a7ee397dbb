"""``fusion-planner check-rules``: is every rewrite rule sound?"""

from __future__ import annotations

import argparse

from fusion_planner.commands.common import emit_json, seed_arg
from fusion_planner.core.errors import UsageError
from fusion_planner.rules.check import DEFAULT_EXAMPLES, RuleResult, check_files, verdict_counts


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
    results = check_files(args.files, examples=args.examples, seed=args.seed)
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


def _line(r: RuleResult) -> str:
    head = f"{r.rule.label}: {r.verdict}"
    if r.verdict == "sound":
        what = f"{r.cases} cases" if r.cases else "no cases needed"
        extra = f"; {r.detail}" if r.detail else ""
        return f"{head} ({what}{extra})  {r.rule.text}"
    return f"{head}  {r.rule.text}\n    {r.detail}"

"""``fusion-planner explain``: the costed candidate plans of a graph."""

from __future__ import annotations

import argparse

from planner.candidates import build_candidates, load_rules
from planner.cli import emit_json
from planner.commands.common import add_graph_args, add_planning_args, graph_from_args, limits_from_args
from planner.errors import UsageError
from planner.report import ledger_table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="list costed candidate plans (no execution)",
        description="Build the e-graph of a graph, extract candidate plans and print their three ledgers.",
    )
    add_graph_args(p)
    add_planning_args(p)
    p.add_argument(
        "--kernel-facts",
        action="store_true",
        help="compile generated kernels with nvcc (sm_90) and show regs/spill bytes/occupancy per kernel",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    graph = graph_from_args(args)
    limits = limits_from_args(args)
    cands = build_candidates(
        graph, args.device, rules=load_rules(args.rules), limits=limits, cap=args.cap, k=args.top, seed=args.seed
    )
    extra = []
    if args.kernel_facts:
        from backends.cupy.facts import annotate_candidates, facts_column, nvcc_available

        if not nvcc_available():
            raise UsageError("--kernel-facts needs nvcc on PATH")
        annotate_candidates(cands)
        extra = [("regs/spill/blk", facts_column)]
    if args.json:
        emit_json(cands.to_json())
        return 0
    scope = "all enumerated" if cands.complete else f"best {len(cands.plans)} of ~{cands.space:,}"
    print(
        f"{graph.name} on {cands.spec.name}: {cands.space:,} candidate plans ({scope}); "
        f"{cands.enodes} e-nodes, {cands.iterations} iterations"
    )
    for note in cands.notes:
        print(f"note: {note}")
    print(ledger_table(cands.plans, cands.best.key, extra))
    b = cands.best
    print(f"best: {b.notation()} {b.composition()}  est {b.est_us:,.2f} us")
    return 0

"""``fusion-planner explain``: the costed candidate plans of a graph."""

from __future__ import annotations

import argparse

from fusion_planner.backends.cupy.facts import annotate_candidates, facts_column, nvcc_available
from fusion_planner.commands.common import (
    add_graph_args,
    add_planning_args,
    emit_json,
    graph_from_args,
    limits_from_args,
)
from fusion_planner.core.errors import UsageError
from fusion_planner.core.graph import Graph
from fusion_planner.core.report import TABLE_PARTS, count_text, ledger_table
from fusion_planner.egraph.candidates import build_candidates
from fusion_planner.egraph.program import Limits
from fusion_planner.model.stack import plan_model
from fusion_planner.rules.load import load_rules


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
    if len(graph.ops) > limits.max_segment_ops:
        return _explain_segments(args, graph, limits)
    cands = build_candidates(
        graph, args.device, rules=load_rules(args.rules), limits=limits, cap=args.cap, k=args.top, seed=args.seed
    )
    extra = []
    if args.kernel_facts:

        if not nvcc_available():
            raise UsageError("--kernel-facts needs nvcc on PATH")
        annotate_candidates(cands)
        extra = [("regs/spill/blk", facts_column)]
    if args.json:
        emit_json(cands.to_json())
        return 0
    scope = "all enumerated" if cands.complete else f"best {len(cands.plans)} of {count_text(cands.space)}"
    print(
        f"{graph.name} on {cands.spec.name}: {count_text(cands.space)} candidate plans ({scope}); "
        f"{cands.enodes} e-nodes, {cands.iterations} iterations"
    )
    for note in cands.notes:
        print(f"note: {note}")
    print(ledger_table(cands.plans, cands.best.key, extra))
    b = cands.best
    print(f"best: {b.notation(TABLE_PARTS)} {b.composition()}  est {b.est_us:,.2f} us")
    return 0


def _explain_segments(args: argparse.Namespace, graph: Graph, limits: Limits) -> int:
    """A graph longer than one e-graph may hold: each segment's best plan by the cost model, composed, beside
    the unfused plan (the candidates of a whole graph this size are not listed)."""
    if args.kernel_facts:
        raise UsageError(f"--kernel-facts lists one e-graph's candidates; {graph.name} has {len(graph.ops):,} ops, more "
                         f"than --max-segment-ops {limits.max_segment_ops:,}")
    mp = plan_model(graph, args.device, rules=load_rules(args.rules), limits=limits, cap=args.cap, k=args.top,
                    seed=args.seed)
    plans = [mp.plan, mp.unfused]
    if args.json:
        emit_json(dict(mp.summary(), device=mp.spec.name, candidates=[dict(p.to_json(), best=p is mp.plan) for p in plans]))
        return 0
    s = mp.summary()
    print(f"{graph.name} on {mp.spec.name}: {s['ops']:,} ops in {s['regions']:,} regions, {s['unique_regions']:,} "
          "distinct; each region's best plan by the cost model, composed")
    for note in mp.notes:
        print(f"note: {note}")
    print(ledger_table(plans, mp.plan.key))
    b = mp.plan
    print(f"best: {b.notation(TABLE_PARTS)} {b.composition()}  est {b.est_us:,.2f} us")
    return 0

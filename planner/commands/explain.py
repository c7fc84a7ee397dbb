"""``fusion-planner explain``: the costed candidate plans of a graph."""

from __future__ import annotations

import argparse

from planner.backend import ExplainColumn
from planner.commands.common import (
    add_graph_args,
    add_planning_args,
    emit_json,
    graph_from_args,
    limits_from_args,
)
from planner.core.cost import DeviceSpec, load_device
from planner.core.errors import UsageError
from planner.core.graph import Graph
from planner.core.report import count_text, ledger_table, plan_title
from planner.egraph.candidates import build_candidates
from planner.egraph.program import Limits
from planner.model.stack import plan_model
from planner.registry import plugins
from planner.rules.load import load_rules


def _columns() -> list[ExplainColumn]:
    """The columns the backend plugins add, each behind its flag."""
    return [c for p in plugins().values() for c in p.explain_columns]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="list costed candidate plans (no execution)",
        description="Build the e-graph of a graph, extract candidate plans and print their three ledgers.",
    )
    add_graph_args(p)
    add_planning_args(p)
    for column in _columns():
        p.add_argument(column.flag, action="store_true", help=column.help)
    p.set_defaults(handler=run)


def _asked(args: argparse.Namespace) -> list[ExplainColumn]:
    return [c for c in _columns() if getattr(args, c.flag.lstrip("-").replace("-", "_"))]


def run(args: argparse.Namespace) -> int:
    graph = graph_from_args(args)
    limits = limits_from_args(args)
    spec = load_device(args.device)
    if len(graph.ops) > limits.max_segment_ops:
        return _explain_segments(args, graph, spec, limits)
    cands = build_candidates(graph, spec, rules=load_rules(args.rules), limits=limits, cap=args.cap, k=args.top,
                             seed=args.seed)
    extra = []
    for column in _asked(args):
        column.annotate(cands)
        extra.append((column.header, column.cell))
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
    print(ledger_table(cands.plans, cands.best.key, extra, full=args.all_rows))
    b = cands.best
    print(f"best: {plan_title(b)}  est {b.est_us:,.2f} us")
    return 0


def _explain_segments(args: argparse.Namespace, graph: Graph, spec: DeviceSpec, limits: Limits) -> int:
    """A graph longer than one e-graph may hold: each segment's best plan by the cost model, composed, beside
    the unfused plan (the candidates of a whole graph this size are not listed)."""
    for column in _asked(args):
        raise UsageError(f"{column.flag} lists one e-graph's candidates; {graph.name} has {len(graph.ops):,} ops, more "
                         f"than --max-segment-ops {limits.max_segment_ops:,}")
    mp = plan_model(graph, spec, rules=load_rules(args.rules), limits=limits, cap=args.cap, k=args.top,
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
    print(ledger_table(plans, mp.plan.key, full=args.all_rows))
    b = mp.plan
    print(f"best: {plan_title(b)}  est {b.est_us:,.2f} us")
    return 0

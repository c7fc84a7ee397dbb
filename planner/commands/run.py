"""``fusion-planner run plan.json``: re-execute a saved plan on a backend, verified against the reference."""

from __future__ import annotations

import argparse
import sys

from planner.backend import BackendError
from planner.commands.common import add_graph_args, add_threads_arg, emit_json, graph_from_args, seed_arg
from planner.core.cost import load_device
from planner.core.errors import UsageError
from planner.core.planfile import PlanFileError, load_plan
from planner.core.reference import execute_graph, random_inputs
from planner.core.report import plan_title
from planner.core.tolerance import check_outputs, check_tolerance_override
from planner.registry import backend_names, get_backend
from planner.search.searchlog import fmt_us
from planner.torch import need_evaluator


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="re-execute a plan.json written by 'plan --out' (verified, then timed)",
        description=(
            "Load a plan file (JSON only: no code is loaded), check its content hash and its fit to its graph, "
            "run it on seeded random inputs, verify it against the numpy reference and time it. "
            "Giving a graph (--example/--graph) also checks that the plan was made for that graph."
        ),
    )
    p.add_argument("plan_file", metavar="plan.json")
    p.add_argument("--backend", default="reference", help=f"one of {', '.join(backend_names())} (default reference)")
    p.add_argument("--device", default=None, help="device spec for the backend (default: the one saved in the plan)")
    add_threads_arg(p)
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random inputs")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rtol", type=float, default=None, help="override the dtype's relative tolerance")
    p.add_argument("--atol", type=float, default=None, help="override the dtype's absolute tolerance")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_graph_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.warmup < 0 or args.repeats < 1:
        raise UsageError("need --warmup >= 0 and --repeats >= 1")
    check_tolerance_override(args.rtol, args.atol)
    given = None
    if args.example or args.graph or args.torch:
        given = graph_from_args(args)
    plan, graph, spec, meta = load_plan(args.plan_file, expect_graph=given)
    if args.device is not None:
        spec = load_device(args.device)
    backend = get_backend(args.backend, spec, threads=args.threads)
    need_evaluator(graph)
    inputs = random_inputs(graph, seed=args.seed)
    try:
        compiled = backend.compile(plan)
        outs = compiled.run(inputs)
    except BackendError as exc:  # a plan this backend cannot build or run: one line, exit 1
        print(f"fusion-planner run: the plan does not run on backend {args.backend}: {exc}", file=sys.stderr)
        return 1
    expected, oracle = execute_graph(graph, inputs, "device"), execute_graph(graph, inputs, "oracle")
    reason, max_abs, max_rel = check_outputs(plan, outs, expected, args.rtol, args.atol, oracle)
    if reason is not None:
        raise PlanFileError(f"{args.plan_file}: the plan does not compute its graph on backend {args.backend}: {reason}")
    meas: float | None = None
    why_not = ""
    try:
        meas = compiled.time(inputs, warmup=args.warmup, repeats=args.repeats).median_us
    except BackendError as exc:
        why_not = str(exc)
    report = {
        "plan": plan.notation(),
        "composition": plan.composition(),
        "graph": graph.name,
        "backend": args.backend,
        "device": spec.name,
        "verified": True,
        "max_abs_err": max_abs,
        "max_rel_err": max_rel,
        "est_us": round(plan.est_us, 4),
        "meas_us": None if meas is None else round(meas, 4),
        "saved": meta,
    }
    if args.json:
        emit_json(report)
        return 0
    print(f"{graph.name}: plan {plan_title(plan)} on backend {args.backend}")
    print(f"verified against the reference: max_abs {max_abs:.3g}, max_rel {max_rel:.3g}")
    timing = fmt_us(meas) if meas is not None else f"not timed ({why_not})"
    print(f"est {fmt_us(plan.est_us)} | meas {timing}")
    return 0

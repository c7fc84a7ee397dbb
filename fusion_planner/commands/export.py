"""``fusion-planner export-candidates``: a self-contained candidates bundle for remote timing."""

from __future__ import annotations

import argparse

from fusion_planner.backends.cupy.bundle import write_bundle
from fusion_planner.backends.cupy.facts import annotate_candidates, nvcc_available
from fusion_planner.commands.common import add_graph_args, add_planning_args, graph_from_args, limits_from_args
from fusion_planner.core.errors import UsageError
from fusion_planner.egraph.candidates import build_candidates
from fusion_planner.rules.load import load_rules


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-candidates",
        help="write candidates with CUDA sources and cuBLASLt calls for `python -m fusion_planner.backends.cupy time`",
        description=(
            "Plan a graph and write every candidate self-contained: kernel bodies, generated CUDA sources, "
            "cuBLASLt calls, shapes, dtypes, input seed and the reference recipe (docs/gpu.md)."
        ),
    )
    add_graph_args(p)
    add_planning_args(p)
    p.add_argument("-o", "--output", required=True, metavar="CANDS.json", help="bundle to write")
    p.add_argument("--input-seed", type=int, default=0, help="seed of the random inputs the runner draws")
    p.add_argument("--kernel-facts", action="store_true", help="attach nvcc sm_90 regs/spills/occupancy to each kernel")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:

    graph = graph_from_args(args)
    limits = limits_from_args(args)
    if len(graph.ops) > limits.max_segment_ops:
        raise UsageError(f"{graph.name} has {len(graph.ops):,} ops, more than one e-graph holds (--max-segment-ops "
                         f"{limits.max_segment_ops:,}); a bundle lists one e-graph's candidates: export a smaller graph")
    cands = build_candidates(
        graph, args.device, rules=load_rules(args.rules), limits=limits, cap=args.cap, k=args.top, seed=args.seed,
    )
    if args.kernel_facts:

        if not nvcc_available():
            raise UsageError("--kernel-facts needs nvcc on PATH")
        annotate_candidates(cands)
    data = write_bundle(cands, args.output, seed=args.input_seed)
    n_cuda = sum(1 for c in data["candidates"] for k in c["kernels"] if "cuda" in k)
    n_lt = sum(1 for c in data["candidates"] for k in c["kernels"] if "cublaslt" in k)
    print(
        f"{graph.name}: wrote {len(data['candidates'])} candidates ({n_cuda} generated kernels, "
        f"{n_lt} cuBLASLt calls) to {args.output}"
    )
    return 0

"""Arguments shared by the subcommands that take a graph."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from typing import Any

from planner.core import examples, limits
from planner.core.cost import DeviceSpec, load_device
from planner.core.errors import UsageError
from planner.core.graph import Graph, load_graph
from planner.core.report import TABLE_ROWS, TABLE_WIDTH
from planner.egraph.candidates import DEFAULT_CAP, DEFAULT_K, CandidateSet, build_candidates
from planner.egraph.program import Limits
from planner.rules.load import load_rules

#: argparse type of every --seed: numpy's generators take only non-negative seeds
seed_arg = limits.int_arg(0)


def add_threads_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--threads", type=limits.positive_arg, default=None, metavar="N",
                   help="cpu backend: worker threads (default $FUSION_PLANNER_THREADS, else every available core)")


def add_graph_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graph (one of --example or --graph)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--example", choices=examples.EXAMPLES, help="a built-in example graph")
    src.add_argument("--graph", metavar="FILE.json", help="a graph JSON file (docs/graph-format.md)")
    src.add_argument("--torch", metavar="FILE.py:FACTORY", help="a torch module: FACTORY() returns (module, example_inputs)")
    g.add_argument("--torch-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="keyword argument of the --torch factory, e.g. d_model=768 (repeatable; numbers stay numbers)")
    g.add_argument("--m", type=int, help="mlp-epilogue/mlp-stack rows M (default 4096; 64 for mlp-stack)")
    g.add_argument("--n", type=int, help="mlp-epilogue N (default 4096); ew-chain/heavy element count")
    g.add_argument("--k", type=int, help="mlp-epilogue K (default 4096); ew-chain stage count (default 4)")
    g.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], help="element type (example default)")
    g.add_argument("--gelu", choices=["tanh", "erf"], default="tanh", help="mlp-epilogue GELU form")
    g.add_argument("--layers", type=int, default=4, help="mlp-stack blocks / transformer layers")
    g.add_argument("--d-model", type=int, default=1024, help="mlp-stack/transformer width")
    g.add_argument("--seq", type=int, default=128, help="transformer sequence length (rows)")
    g.add_argument("--mlp", choices=["gelu", "swiglu"], default="gelu", help="transformer MLP kind")
    p.add_argument(
        "--allow-torch-op", action="append", default=[], metavar="NAME",
        help="trust one more torch callable named by the graph/plan file, by exact canonical name, e.g. "
        "torch.nn.functional.mish (repeatable; docs/security.md)",
    )


def add_planning_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planning")
    g.add_argument("--device", default=None, help="built-in spec (seed-k4, h200, rtx5090) or a JSON spec file; default: the backend's "
                   "own (cpu: this machine, calibrated once), else h200")
    g.add_argument("--rules", action="append", default=[], metavar="FILE.egg", help="extra rule file (repeatable)")
    g.add_argument("--cap", type=int, default=DEFAULT_CAP, help="enumerate every plan up to this many")
    g.add_argument("--top", type=int, default=DEFAULT_K, help="plans to keep when the space is larger than --cap")
    g.add_argument("--seed", type=seed_arg, default=0, help="seed for sampling")
    d = Limits()
    g.add_argument("--max-iterations", type=int, default=d.max_iterations, help="saturation iterations per stage")
    g.add_argument("--max-nodes", type=int, default=d.max_nodes, help="e-graph size limit")
    g.add_argument("--time-limit", type=float, default=d.time_limit_s, help="saturation time limit (s)")
    g.add_argument("--max-region-ops", type=int, default=d.max_region_ops, help="ops in one fused kernel")
    g.add_argument("--max-segment-ops", type=int, default=d.max_segment_ops,
                   help="ops in one e-graph; a longer graph is planned in segments (docs/scaling.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--all", action="store_true", dest="all_rows",
                   help=f"list every candidate at full width (default: at most {TABLE_ROWS} rows of "
                        f"{TABLE_WIDTH} characters: the best, the unfused plan, the Pareto front, runners-up)")


def limits_from_args(args: argparse.Namespace) -> Limits:
    for name in ("max_iterations", "max_nodes", "max_region_ops", "max_segment_ops", "cap", "top"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    depth = limits.current().depth
    if args.max_region_ops >= depth:  # a body of N ops is N + 1 levels deep, its loads included
        raise UsageError(f"--max-region-ops {args.max_region_ops} needs --max-depth above it (now {depth}): a "
                         "fused kernel that large could not be read back from its plan file")
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise UsageError(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    return Limits(
        max_iterations=args.max_iterations,
        max_nodes=args.max_nodes,
        time_limit_s=args.time_limit,
        max_region_ops=args.max_region_ops,
        max_segment_ops=args.max_segment_ops,
    )


def graph_from_args(args: argparse.Namespace) -> Graph:
    if args.graph:
        return load_graph(args.graph)
    if getattr(args, "torch", None):
        if importlib.util.find_spec("torch") is None:
            raise UsageError("--torch needs PyTorch, which is not installed here: `make install` installs it "
                             "(or pip install torch==2.13.0, then pip install -e '.[torch]')")
        from planner.torch.importer import factory_kwargs, graph_from_factory

        return graph_from_factory(args.torch, factory_kwargs(args.torch_arg))
    ex = args.example
    if ex is None:
        raise UsageError("give --example NAME, --graph FILE.json or --torch FILE.py:FACTORY")
    for name in ("m", "n", "k", "layers", "d_model", "seq"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    if ex == "mlp-epilogue":
        return examples.mlp_epilogue(args.m or 4096, args.n or 4096, args.k or 4096, args.dtype or "fp16", args.gelu)
    if ex == "heavy":
        return examples.heavy(args.n or 2**26, args.dtype or "fp16")
    if ex == "ew-chain":
        return examples.ew_chain(args.k or 4, args.n or 2**24, args.dtype or "fp32")
    if ex == "mlp-stack":
        return examples.mlp_stack(args.layers, args.d_model, args.m or 64, args.dtype or "fp16")
    if ex == "transformer":
        return examples.transformer(args.layers, args.d_model, args.seq, args.dtype or "fp16", args.mlp)
    raise UsageError(f"unknown example {ex!r}")


def emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=1, default=_json_default)
    sys.stdout.write("\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_json"):
        return o.to_json()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def candidates_from_args(args: argparse.Namespace, graph: Graph) -> CandidateSet:
    """The costed candidates of one e-graph under the planning arguments (a longer graph is refused)."""
    limits = limits_from_args(args)
    if len(graph.ops) > limits.max_segment_ops:
        raise UsageError(f"{graph.name} has {len(graph.ops):,} ops, more than one e-graph holds (--max-segment-ops "
                         f"{limits.max_segment_ops:,}); this command lists one e-graph's candidates: give a smaller graph")
    return build_candidates(graph, load_device(args.device), rules=load_rules(args.rules), limits=limits, cap=args.cap, k=args.top,
                            seed=args.seed)


class CliPlanning:
    """The :class:`planner.backend.Planning` the command line lends a backend's subcommands."""

    add_graph_args = staticmethod(add_graph_args)
    add_planning_args = staticmethod(add_planning_args)
    graph = staticmethod(graph_from_args)
    candidates = staticmethod(candidates_from_args)
    emit_json = staticmethod(emit_json)

    @staticmethod
    def device(name: str | None) -> DeviceSpec:
        return load_device(name)

    @staticmethod
    def candidates_of(graph: Graph, spec: DeviceSpec, *, cap: int) -> CandidateSet:
        return build_candidates(graph, spec, cap=cap)

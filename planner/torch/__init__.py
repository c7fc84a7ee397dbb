"""The torch layer: tracing a module, importing it into the IR, binding its parameters, and the
torch-backed Opaque implementations. Importing this package itself imports no torch.
"""

from __future__ import annotations

from planner.core.errors import UsageError
from planner.core.graph import Graph
from planner.core.opaque import has_torch_steps, torch_evaluator_loaded


def need_evaluator(graph: Graph) -> None:
    """Load the evaluator of torch-backed Opaque nodes when ``graph`` holds one (torch is optional, so it is
    imported only then); without torch such a graph is a usage error naming the node."""
    if torch_evaluator_loaded() or not has_torch_steps(graph.ops):
        return
    try:
        import planner.torch.ops  # noqa: F401 - installs the evaluator on import
    except ImportError as exc:
        node = next(n for n in graph.ops if n.op == "Opaque" and str(n.attr_dict.get("impl", "")).startswith("torch."))
        raise UsageError(f"graph {graph.name!r}: node {node.id!r} runs {node.attr_dict.get('impl')}, which needs torch "
                         f"({exc})") from None


__all__ = ["need_evaluator"]

"""Long graphs the segment tests share: chains that neither overflow nor repeat unless asked to."""

from __future__ import annotations

import json
from pathlib import Path

from planner.core.graph import Graph, GraphBuilder


def long_chain(n: int, width: int = 16, *, period: int | None = None) -> Graph:
    """``n`` ops cycling Affine, Tanh, Relu (bounded values in any length). Each Affine's scale differs,
    so no two segments are alike, unless ``period`` repeats the scales every that many ops."""
    b = GraphBuilder(f"chain{n}" + (f"-p{period}" if period else ""))
    y = b.input("x", (width,), "fp32")
    for i in range(n):
        step = i % period if period else i
        if i % 3 == 0:
            y = b.op(f"n{i}", "Affine", [y], {"a": 0.9 + (step % 997) * 1e-4, "b": 0.05})
        else:
            y = b.op(f"n{i}", "Tanh" if i % 3 == 1 else "Relu", [y])
    return b.build([y])


def write_graph(g: Graph, path: Path) -> Path:
    path.write_text(json.dumps(g.to_json()))
    return path

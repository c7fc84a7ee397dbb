"""The serialized e-graph, indexed for extraction: its classes and e-nodes, which classes are stored and which are
inputs, each class's graph tensor, type and topological order, and the classes of the graph outputs."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from planner.core.graph import Graph, TensorType
from planner.core.kinds import OpKind
from planner.core.ops import OPS
from planner.egraph.program import let_name

log = logging.getLogger(__name__)


class ExtractionError(RuntimeError):
    """The e-graph holds no valid plan (a rule bug, never bad user input)."""


@dataclass(frozen=True)
class ENode:
    op: str
    children: tuple[str, ...]  # e-class ids of Op-sorted children
    lits: tuple[Any, ...]  # literal arguments (attributes, names)


@dataclass
class EGraphView:
    """The serialized e-graph, indexed for extraction."""

    classes: dict[str, list[ENode]]
    stored: set[str]
    inputs: set[str]
    tensor: dict[str, str]  # stored class -> tensor (graph node id)
    value_node: dict[str, str]  # value class -> graph node id
    types: dict[str, TensorType]
    order: dict[str, int]  # stored class -> topological index
    roots: tuple[str, ...]  # stored classes of the graph outputs


def view_egraph(serialized: dict[str, Any], graph: Graph) -> EGraphView:
    nodes = serialized["nodes"]
    class_data = serialized.get("class_data", {})
    lit_of: dict[str, Any] = {}
    for key, n in nodes.items():
        sort = n["eclass"].split("-")[0]
        if sort in ("String", "f64", "i64"):
            lit_of[key] = json.loads(n["op"]) if sort == "String" else _number(n["op"], sort)
    list_of: dict[str, list[str]] = {}
    for n in nodes.values():
        if n["op"] == "Nil":
            list_of[n["eclass"]] = []
    # OpList classes are built from the graph only, so each holds one Cons/Nil chain
    cons = {n["eclass"]: n for n in nodes.values() if n["op"] == "Cons"}

    def flatten(list_class: str) -> list[str]:
        out: list[str] = []
        while list_class in cons:
            head, tail = cons[list_class]["children"]
            out.append(nodes[head]["eclass"])
            list_class = nodes[tail]["eclass"]
        return out

    classes: dict[str, list[ENode]] = {}
    for n in nodes.values():
        cls = n["eclass"]
        if not cls.startswith("Op-") or n.get("subsumed"):
            continue
        kids: list[str] = []
        lits: list[Any] = []
        for c in n["children"]:
            if c in lit_of:
                lits.append(lit_of[c])
            elif nodes[c]["eclass"].startswith("OpList"):
                kids.extend(flatten(nodes[c]["eclass"]))
            else:
                kids.append(nodes[c]["eclass"])
        classes.setdefault(cls, []).append(ENode(n["op"], tuple(kids), tuple(lits)))

    stored = {c for c, ns in classes.items() if any(n.op in ("K", "In", "CublasLt") for n in ns)}
    inputs = {c for c, ns in classes.items() if any(n.op == "In" for n in ns)}
    let_to_node = {let_name(i): n for i, n in enumerate(graph.nodes)}
    tensor: dict[str, str] = {}
    types: dict[str, TensorType] = {}
    order: dict[str, int] = {}
    index = {n.id: i for i, n in enumerate(graph.nodes)}
    for cls, data in class_data.items():
        # merged (CSE) nodes share a class: egglog lists its lets as "$n1, $n2"; the first names it
        merged = [let_to_node[x] for x in _lets(data) if x in let_to_node]
        if merged:
            node = min(merged, key=lambda n: index[n.id])
            tensor[cls] = node.id
            types[cls] = node.type
            order[cls] = index[node.id]
    for cls in stored:
        if cls not in tensor:
            raise ExtractionError(f"stored e-class {cls} has no graph node (a rule stored a new value)")
    # class_data names one let per class; merged (CSE) nodes share the class
    value_node: dict[str, str] = {}
    for cls in sorted(stored, key=lambda c: order.get(c, -1)):
        for n in classes[cls]:
            if n.op == "K":
                (v,) = n.children
                value_node.setdefault(v, tensor[cls])
                types.setdefault(v, types[cls])
    _infer_types(classes, types)
    class_of_let = {x: c for c, d in class_data.items() for x in _lets(d)}
    alias = structural_aliases(graph)
    roots = []
    for o in graph.outputs:
        cls = class_of_let.get(let_name(index[alias[o]]))
        if cls is None:
            raise ExtractionError(f"output {o!r} was merged with another node and has no e-class of its own")
        roots.append(cls)
    return EGraphView(classes, stored, inputs, tensor, value_node, types, order, tuple(roots))


def _infer_types(classes: dict[str, list[ENode]], types: dict[str, TensorType]) -> None:
    """Types of value classes a rule created (e.g. distributing a Mul adds two new products),
    from the op table's shape rules over their children's types."""
    changed = True
    while changed:
        changed = False
        for cls, enodes in classes.items():
            if cls in types:
                continue
            for n in enodes:
                opd = OPS.get(n.op)
                if opd is None or opd.shape_rule is None or opd.kind == OpKind.OPAQUE or not n.children:
                    continue
                if not all(c in types for c in n.children):
                    continue
                attrs = {a.name: lit for a, lit in zip(opd.attrs, n.lits, strict=False)}
                shape = opd.out_shape([types[c].shape for c in n.children], attrs)
                dtype = opd.out_dtype([types[c].dtype for c in n.children], attrs)
                assert dtype is not None  # an op with children
                types[cls] = TensorType(shape, dtype)
                changed = True
                break


def _lets(class_data: dict[str, Any]) -> list[str]:
    return [x.strip() for x in class_data.get("let", "").split(",") if x.strip()]


def structural_aliases(graph: Graph) -> dict[str, str]:
    """Map each node to the first node with the same term (egglog hash-conses them)."""
    alias: dict[str, str] = {}
    first: dict[Any, str] = {}
    for n in graph.nodes:
        key: Any = n.id if n.op in ("In", "Opaque") else (n.op, tuple(alias[i] for i in n.inputs), n.attrs)
        alias[n.id] = first.setdefault(key, n.id)
    return alias


def _number(text: str, sort: str) -> Any:
    return int(text) if sort == "i64" else float(text)


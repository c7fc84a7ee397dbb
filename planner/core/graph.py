"""Op-graph IR: validated nodes with shapes and dtypes, and its JSON form.

A :class:`Graph` is immutable and always valid: node ids are unique and safe,
every input refers to an earlier node (topological order), every op is in the
op table, attributes are coerced and every shape is inferred and checked on
construction.  ``docs/graph-format.md`` documents the JSON schema.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from planner.core import limits
from planner.core.dtypes import DTYPES
from planner.core.files import read_json
from planner.core.ops import OpError, op_def
from planner.core.schema import check_document
from planner.core.shapes import Shape
from planner.core.torch_allowlist import loading_file

GRAPH_FORMAT = "fusion-planner-graph"
GRAPH_VERSION = 1
_ID_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,127}$")


class GraphError(ValueError):
    """The graph is malformed; the message names the node or field."""


@dataclass(frozen=True)
class TensorType:
    shape: Shape
    dtype: str

    @property
    def elems(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.elems * DTYPES[self.dtype].bytes


@dataclass(frozen=True)
class Node:
    id: str
    op: str
    inputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...]
    type: TensorType

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)


@dataclass(frozen=True)
class Graph:
    name: str
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    _index: Mapping[str, Node] = field(default_factory=dict, compare=False, repr=False)

    def __getitem__(self, node_id: str) -> Node:
        return self._index[node_id]

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._index

    @property
    def ops(self) -> list[Node]:
        """Nodes that compute something (everything but inputs)."""
        return [n for n in self.nodes if n.op != "In"]

    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.nodes if n.op == "In"]

    def live(self) -> Graph:
        """The graph without the ops no output depends on (what a module computes and its result leaves unused);
        every input stays (a call feeds them all).  The graph itself where every op is live, or none is."""
        needed = set(self.outputs)
        for n in reversed(self.nodes):
            if n.id in needed:
                needed.update(n.inputs)
        nodes = tuple(n for n in self.nodes if n.op == "In" or n.id in needed)
        if len(nodes) == len(self.nodes) or all(n.op == "In" for n in nodes):
            return self
        return Graph(self.name, nodes, self.outputs, {n.id: n for n in nodes})

    def consumers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.id)
        return out

    def is_chain(self) -> bool:
        """True when every op consumes the previous op (inputs aside): a linear chain."""
        prev: str | None = None
        for n in self.ops:
            computed = [i for i in n.inputs if self[i].op != "In"]
            if prev is None:
                if computed:
                    return False
            elif prev not in computed:
                return False
            prev = n.id
        return prev is not None and self.outputs == (prev,)

    # ------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        nodes = []
        for n in self.nodes:
            d: dict[str, Any] = {"id": n.id, "op": n.op}
            if n.inputs:
                d["inputs"] = list(n.inputs)
            if n.attrs:
                d["attrs"] = dict(n.attrs)
            d["shape"] = list(n.type.shape)
            d["dtype"] = n.type.dtype
            nodes.append(d)
        return {
            "format": GRAPH_FORMAT,
            "version": GRAPH_VERSION,
            "name": self.name,
            "nodes": nodes,
            "outputs": list(self.outputs),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def fingerprint(self) -> str:
        """SHA-256 of the graph's structure (ops, wiring, attributes, shapes, dtypes; not its name)."""

        body = self.to_json()
        body.pop("name")
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class GraphBuilder:
    """Builds a :class:`Graph` node by node, checking each node as it is added."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self._nodes: dict[str, Node] = {}
        self._limits = limits.current()

    @property
    def nodes(self) -> Mapping[str, Node]:
        """The nodes added so far, by id (read-only)."""
        return MappingProxyType(self._nodes)

    def input(self, node_id: str, shape: Sequence[int], dtype: str) -> str:
        shape_t, dtype = tensor_type(shape, dtype, node_id, self._limits)
        self._add(Node(_check_id(node_id), "In", (), (), TensorType(shape_t, dtype)))
        return node_id

    def op(
        self,
        node_id: str,
        op: str,
        inputs: Sequence[str],
        attrs: Mapping[str, Any] | None = None,
        *,
        shape: Sequence[int] | None = None,
        dtype: str | None = None,
    ) -> str:
        """Add an op node; ``shape``/``dtype`` if given must match what is inferred."""
        _check_id(node_id)
        if not isinstance(op, str):
            raise GraphError(f"node {node_id!r}: 'op' must be an op name (a string), got {type(op).__name__}")
        if op == "In":
            if shape is None or dtype is None:
                raise GraphError(f"node {node_id!r}: an In node needs 'shape' and 'dtype'")
            return self.input(node_id, shape, dtype)
        try:
            d = op_def(op)
        except OpError as exc:
            raise GraphError(f"node {node_id!r}: {exc}") from None
        missing = [i for i in inputs if i not in self._nodes]
        if missing:
            raise GraphError(
                f"node {node_id!r}: input(s) {missing} not defined before it "
                "(graphs must be acyclic and listed in topological order)"
            )
        in_types = [self._nodes[i].type for i in inputs]
        try:
            clean = d.check_attrs(dict(attrs or {}))
            out_shape = d.out_shape([t.shape for t in in_types], clean)
            inferred = d.out_dtype([t.dtype for t in in_types], clean)
        except OpError as exc:
            raise GraphError(f"node {node_id!r}: {exc}") from None
        _check_size(out_shape, node_id, self._limits)  # an op may compute a larger tensor than its inputs (a GEMM)
        out_dtype = dtype or inferred
        if not isinstance(out_dtype, str) or out_dtype not in DTYPES:
            raise GraphError(f"node {node_id!r}: cannot determine a valid dtype")
        if inferred is not None and out_dtype != inferred:
            raise GraphError(f"node {node_id!r}: dtype {out_dtype} differs from the {inferred} {op} gives")
        if shape is not None and (not isinstance(shape, (list, tuple)) or tuple(shape) != out_shape):
            raise GraphError(
                f"node {node_id!r}: declared shape {str(shape)[:60]} but {op} gives {list(out_shape)}"
            )
        node = Node(node_id, op, tuple(inputs), tuple(sorted(clean.items())), TensorType(out_shape, out_dtype))
        self._add(node)
        return node_id

    def shape_of(self, node_id: str) -> tuple[int, ...]:
        """The shape of a node added so far."""
        return self._nodes[node_id].type.shape

    def dtype_of(self, node_id: str) -> str:
        """The dtype of a node added so far."""
        return self._nodes[node_id].type.dtype

    def build(self, outputs: Iterable[str]) -> Graph:
        outs = tuple(outputs)
        if not any(n.op != "In" for n in self._nodes.values()):
            raise GraphError(f"graph {self.name!r} is empty: it has no op nodes")
        if not outs:
            raise GraphError(f"graph {self.name!r} has no outputs")
        for o in outs:
            if o not in self._nodes:
                raise GraphError(f"output {o!r} is not a node of graph {self.name!r}")
        nodes = tuple(self._nodes.values())
        return Graph(self.name, nodes, outs, dict(self._nodes))

    def _add(self, node: Node) -> None:
        if node.id in self._nodes:
            raise GraphError(f"duplicate node id {node.id!r}")
        if len(self._nodes) >= self._limits.graph_nodes:  # a built-in example or an importer's graph, as a file's
            raise GraphError(f"graph {self.name!r}: more than {self._limits.graph_nodes:,} nodes "
                             f"({limits.flag_of('graph_nodes')})")
        self._nodes[node.id] = node


def _check_id(node_id: Any) -> str:
    if not isinstance(node_id, str) or not _ID_RE.match(node_id):
        raise GraphError(
            f"bad node id {node_id!r}: ids are 1-128 characters of letters, digits, '_' and '.', "
            "starting with a letter or '_'"
        )
    return node_id


def tensor_type(shape: Any, dtype: Any, node_id: str, lim: limits.InputLimits | None = None) -> tuple[Shape, str]:
    """A checked (shape, dtype) pair of untrusted data, with the size limits in force."""
    shape_t = _check_shape(shape, node_id, lim or limits.current())
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise GraphError(f"node {node_id!r}: unknown dtype {str(dtype)[:40]!r}; expected one of {sorted(DTYPES)}")
    return shape_t, dtype


def _check_shape(shape: Any, node_id: str, lim: limits.InputLimits) -> Shape:
    if not isinstance(shape, (list, tuple)) or not shape:
        raise GraphError(f"node {node_id!r}: 'shape' must be a non-empty list of positive integers")
    if len(shape) > lim.rank:  # before the dims are looked at: a rank-10^6 shape is refused at once
        _check_size(tuple(shape), node_id, lim)
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            raise GraphError(f"node {node_id!r}: bad dimension {str(d)[:40]!r} in shape")
    _check_size(tuple(shape), node_id, lim)
    return tuple(shape)


def _check_size(shape: Shape, node_id: str, lim: limits.InputLimits) -> None:
    if len(shape) > lim.rank:
        raise GraphError(f"node {node_id!r}: rank {len(shape)} exceeds the limit of {lim.rank} dimensions "
                         f"({limits.flag_of('rank')})")
    elems = math.prod(shape)
    if elems > lim.elements:
        raise GraphError(
            f"node {node_id!r}: a tensor of {elems:.3g} elements exceeds the limit of {lim.elements:,} "
            f"({limits.flag_of('elements')}; every tensor must fit in memory to be verified)"
        )


# ---------------------------------------------------------------- loading


def graph_from_json(data: Any, source: str = "<json>", *, allow_torch: Iterable[str] = ()) -> Graph:
    """Build a graph from parsed JSON, with errors that name the file and the field or node.

    The data is untrusted: torch-backed Opaque nodes may name only allowlisted torch
    callables, the user's ``allow_torch_ops`` and ``allow_torch`` (docs/security.md).
    """
    with loading_file(allow_torch):
        return _graph_from_json(data, source)


def _graph_from_json(data: Any, source: str) -> Graph:
    max_nodes = limits.current().graph_nodes
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if isinstance(nodes, list) and len(nodes) > max_nodes:  # before anything walks them
        raise GraphError(f"{source}: {len(nodes):,} nodes exceed the limit of {max_nodes:,} "
                         f"({limits.flag_of('graph_nodes')})")
    check_document(data, "graph", source, GraphError)
    b = GraphBuilder(_graph_name(data.get("name", Path(source).stem), source))
    first_at: dict[str, int] = {}
    for i, nd in enumerate(data["nodes"]):
        first_at.setdefault(nd["id"], i)
    seen: set[str] = set()
    for i, nd in enumerate(data["nodes"]):
        nid, inputs, attrs = nd["id"], nd.get("inputs", []), nd.get("attrs", {})
        later = [x for x in inputs if x not in seen]
        if later and any(x == nid or first_at.get(x, -1) >= i for x in later):
            raise GraphError(
                f"{source}: node {nid!r}: input(s) {later} come later in the list or from itself: "
                "the graph has a cycle or is not in topological order"
            )
        if nd["op"] == "In" and (attrs or inputs):
            raise GraphError(f"{source}: node {nid!r}: an In node takes no 'inputs' and no 'attrs'")
        try:
            b.op(nid, nd["op"], inputs, attrs, shape=nd.get("shape"), dtype=nd.get("dtype"))
        except GraphError as exc:
            raise GraphError(f"{source}: {exc}") from None
        seen.add(nid)
    return b.build(data["outputs"])


def _graph_name(name: Any, source: str) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= 256:
        raise GraphError(f"{source}: 'name' must be a string of 1 to 256 characters")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise GraphError(f"{source}: 'name' is not valid Unicode text (a lone surrogate)") from None
    return name


def torch_names(graph: Graph) -> frozenset[str]:
    """Every torch callable the graph's torch-backed Opaque nodes name (node impls and call steps)."""
    names: set[str] = set()
    for n in graph.nodes:
        impl = str(n.attr_dict.get("impl", "")) if n.op == "Opaque" else ""
        if impl.startswith("torch."):
            names.add(impl)
            call = json.loads(str(n.attr_dict.get("call", "{}")))
            names.update(str(st.get("impl")) for st in call.get("steps", []) if isinstance(st, dict))
    return frozenset(names)


def load_graph(path: str | Path) -> Graph:
    p = Path(path)
    return graph_from_json(read_json(p, GraphError, "graph file"), str(p))

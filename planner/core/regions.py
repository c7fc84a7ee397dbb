"""Structural deduplication: split a graph at forced stores, hash the pieces.

A *boundary* is a point in the topological order where exactly one computed value
is live and that value must be stored anyway: a GEMM or an Opaque op reads it
(both read their operands from memory) or it is a graph output.  Cutting there
loses no fusion the rules could express, so each piece (a *region*) can be planned
on its own.  Regions are canonicalised (inputs and ops renamed by first use) and
hashed; identical hashes mean identical subgraphs up to renaming, such as the
layers of a transformer imported from torch, which carries no layer markers.

*Side values* do not stop a cut: values that every plan stores and that were not computed from the piece's
entry (the value of the cut it starts at), such as an attention mask prepared once and read by every layer.
Within a piece, the *side ops* (those not computed from its entry) that hand the rest only values stored
anyway form a region of their own before it: the layers of a model with a padding mask then repeat, though the
first layer also prepares the mask.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from planner.core.graph import Graph, GraphBuilder, Node
from planner.core.kinds import OpKind
from planner.core.ops import OPS

#: op kinds that read every operand from memory
_MEMORY_READERS = {name for name, op in OPS.items() if op.kind in (OpKind.MATMUL, OpKind.STANDALONE, OpKind.OPAQUE)}


@dataclass(frozen=True)
class Region:
    index: int
    ops: tuple[str, ...]  # global ids of the region's ops, in order
    inputs: tuple[str, ...]  # external tensors read, canonical order (first use)
    outputs: tuple[str, ...]  # values used after the region (or graph outputs)
    key: str  # structural hash of the canonical subgraph
    graph: Graph  # canonical subgraph: inputs i0.., ops n0..

    def renaming(self) -> dict[str, str]:
        """Canonical name -> global name."""
        m = {f"i{j}": g for j, g in enumerate(self.inputs)}
        m.update({f"n{j}": g for j, g in enumerate(self.ops)})
        return m


def forced_stores(graph: Graph) -> set[str]:
    """Values every plan stores: graph outputs and operands of GEMMs and Opaque ops; and values held
    across one (a residual stream: read by a norm's row kernel and again after the GEMMs that depend on
    it). A plan could recompute such a value in its later consumer instead, from the operands it was
    computed from, which are no fewer bytes to read; the cut gives that option up."""
    forced = set(graph.outputs)
    ops = graph.ops
    pos = {n.id: i for i, n in enumerate(ops)}
    last_use: dict[str, int] = {}
    first_reader: dict[str, int] = {}  # the earliest memory reader that depends on the value
    for i, n in enumerate(ops):
        for x in n.inputs:
            last_use[x] = max(last_use.get(x, -1), i)
    for i in range(len(ops) - 1, -1, -1):
        n = ops[i]
        reach = min(i if n.op in _MEMORY_READERS else len(ops), first_reader.get(n.id, len(ops)))
        for x in n.inputs:
            if x in pos:
                first_reader[x] = min(first_reader.get(x, len(ops)), reach)
        if n.op in _MEMORY_READERS:
            forced.update(n.inputs)
    forced.update(v for v, r in first_reader.items() if last_use.get(v, -1) > r)
    return forced


def boundaries(graph: Graph, max_ops: int | None = None) -> list[int]:
    """Indices into ``graph.ops`` after which the graph is cut: at forced stores (see ``_natural_cuts``), and
    where a piece would hold more than ``max_ops`` ops, at the cheapest point of its second half (see
    ``_size_cuts``)."""
    return _cuts(graph, max_ops)[0]


def _cuts(graph: Graph, max_ops: int | None) -> tuple[list[int], set[int], set[str]]:
    """:func:`boundaries`, the natural cuts among them, and the forced stores."""
    ops = graph.ops
    forced = forced_stores(graph)
    last_use = _last_uses(graph)
    natural = _natural_cuts(graph, forced, last_use)
    if max_ops is None or len(ops) <= max_ops:
        return natural, set(natural), forced
    pos = {n.id: i for i, n in enumerate(ops)}
    return _size_cuts(graph, natural, forced, pos, last_use, max_ops), set(natural), forced


def _last_uses(graph: Graph) -> dict[str, int]:
    """Each value's last reader (its index in ``graph.ops``); past the end for graph outputs."""
    computed = {n.id for n in graph.ops}
    last_use: dict[str, int] = {}
    for i, n in enumerate(graph.ops):
        for x in n.inputs:
            if x in computed:
                last_use[x] = max(last_use.get(x, -1), i)
    for o in graph.outputs:
        last_use[o] = len(graph.ops)
    return last_use


def _natural_cuts(graph: Graph, forced: set[str], last_use: dict[str, int]) -> list[int]:
    """Cut after an op whose value is stored anyway where every other value live across that point is a side
    value: stored anyway too, and not computed from the current piece's entry (before the first cut: none may
    be live)."""
    ops = graph.ops
    cuts: list[int] = []
    live: set[str] = set()
    stream: set[str] | None = None  # values computed from the current piece's entry; None before the first cut
    for i, n in enumerate(ops):
        if last_use.get(n.id, -1) > i:
            live.add(n.id)
        live -= {x for x in n.inputs if last_use.get(x) == i}
        if stream is not None and any(x in stream for x in n.inputs):
            stream.add(n.id)
        if i == len(ops) - 1 or n.id not in forced or n.id not in live:
            continue
        others = live - {n.id}
        if not others or (stream is not None and others <= forced and not others & stream):
            cuts.append(i)
            stream = {n.id}
    return cuts


def _side_ops(members: Sequence[Node], entry: str, forced: set[str]) -> list[Node]:
    """The ops of a piece not computed from its ``entry`` that may run before the others as a region of their
    own: each hands the others only values stored anyway. A side op whose value a fused kernel of the rest could
    read in registers stays with the rest, and so do the side ops it reads that way and the ops that read it."""
    readers: dict[str, list[str]] = {}
    for n in members:
        for x in n.inputs:
            readers.setdefault(x, []).append(n.id)
    staying, grew = {entry}, True
    while grew:
        before = len(staying)
        for n in members:  # computed from a staying value
            if any(x in staying for x in n.inputs):
                staying.add(n.id)
        for n in reversed(members):  # read by a staying op where no plan need store it
            if n.id not in forced and any(r in staying for r in readers.get(n.id, ())):
                staying.add(n.id)
        grew = len(staying) > before
    leaving = [n for n in members if n.id not in staying]
    return leaving if len(leaving) < len(members) else []


def _size_cuts(graph: Graph, cuts: list[int], forced: set[str], pos: dict[str, int], last_use: dict[str, int],
               max_ops: int) -> list[int]:
    """``cuts`` plus cuts that keep every piece within ``max_ops`` ops (the segment limit: one e-graph
    and one extraction stay bounded however long the graph is).  A cut stores every value live across
    it; those stored anyway cost nothing, so each cut goes where the fewest other bytes are live, the
    latest such point of the piece's second half (a chain: anywhere, one value; a fan-out of graph
    outputs: anywhere, nothing).  Kernels do not span a cut."""
    ops = graph.ops
    extra = [0] * (len(ops) + 1)  # bytes a cut after op i stores that no plan stores otherwise
    for v, u in last_use.items():
        if v not in forced and u > pos[v]:
            extra[pos[v]] += graph[v].type.nbytes
            extra[u] -= graph[v].type.nbytes
    for i in range(1, len(ops)):
        extra[i] += extra[i - 1]
    out = list(cuts)
    for start, end in zip([0] + [c + 1 for c in cuts], [c + 1 for c in cuts] + [len(ops)], strict=True):
        while end - start > max_ops:
            latest_first = range(start + max_ops - 1, start + max(1, max_ops // 2) - 2, -1)
            cut = min(latest_first, key=extra.__getitem__)
            out.append(cut)
            start = cut + 1
    return sorted(out)


def split_regions(graph: Graph, max_ops: int | None = None) -> list[Region]:
    """The graph's regions, in order; with ``max_ops``, none longer than that where a cut exists."""
    pieces = _pieces(graph, *_cuts(graph, max_ops))
    used_later: dict[str, int] = {}
    for r, members in enumerate(pieces):
        for n in members:
            for x in n.inputs:
                used_later[x] = max(used_later.get(x, -1), r)
    regions = []
    graph_outputs = set(graph.outputs)
    for r, members in enumerate(pieces):
        inside = {n.id for n in members}
        outputs = tuple(
            n.id for n in members if used_later.get(n.id, -1) > r or n.id in graph_outputs
        )
        regions.append(_canonical(graph, r, members, inside, outputs))
    return regions


def _pieces(graph: Graph, cuts: list[int], natural: set[int], forced: set[str]) -> list[list[Node]]:
    """The ops between the cuts, in order; a piece that starts at a natural cut and holds side ops is two: those
    side ops, then the rest (``_side_ops``)."""
    ops = graph.ops
    pieces: list[list[Node]] = []
    for s, e in zip([0] + [c + 1 for c in cuts], [c + 1 for c in cuts] + [len(ops)], strict=True):
        members = ops[s:e]
        side = _side_ops(members, ops[s - 1].id, forced) if s - 1 in natural else []
        leaving = {n.id for n in side}
        pieces += [side, [n for n in members if n.id not in leaving]] if side else [members]
    return pieces


def whole_graph_region(graph: Graph) -> Region:
    """The whole graph as one canonical region: the plan-cache key of a graph searched whole."""
    ops = graph.ops
    return _canonical(graph, 0, ops, {n.id for n in ops}, tuple(dict.fromkeys(graph.outputs)))


def _canonical(graph: Graph, index: int, members: list, inside: set[str], outputs: tuple[str, ...]) -> Region:
    inputs: dict[str, None] = {}  # ordered by first use
    for n in members:
        for x in n.inputs:
            if x not in inside:
                inputs.setdefault(x)
    local = {g: f"i{j}" for j, g in enumerate(inputs)}
    local.update({n.id: f"n{j}" for j, n in enumerate(members)})
    b = GraphBuilder(f"{graph.name}.r{index}")
    for j, g in enumerate(inputs):
        t = graph[g].type
        b.input(f"i{j}", t.shape, t.dtype)
    for n in members:
        b.op(local[n.id], n.op, [local[x] for x in n.inputs], n.attr_dict)
    sub = b.build([local[o] for o in outputs])
    canon = sub.to_json()
    canon.pop("name")
    key = hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()[:20]
    return Region(index, tuple(n.id for n in members), tuple(inputs), outputs, key, sub)

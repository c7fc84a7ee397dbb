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

*Repeats* are cut too: a region that occurs once but starts with the ops of another region, one with a GEMM,
and holds no GEMM after them is cut after them, as the last layer of a language model is (it also holds the
model's final norm): that layer then repeats the others, and one region search serves them all, for the values
live across the cut stored.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from planner.core.cost import DeviceSpec, unfused_estimate_us
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


def split_regions(graph: Graph, max_ops: int | None = None, *, repeats: bool = True) -> list[Region]:
    """The graph's regions, in order; with ``max_ops``, none longer than that where a cut exists; with
    ``repeats``, a region that is another region (with a GEMM) followed by a few ops (without one) is cut after
    the other's (``_repeat_cuts``)."""
    pieces = _pieces(graph, *_cuts(graph, max_ops))
    readers = _readers(graph)
    regions = [_region(graph, r, members, readers) for r, members in enumerate(pieces)]
    if repeats:
        pieces = _repeat_cuts(graph, pieces, regions, readers)
        if len(pieces) > len(regions):
            regions = [_region(graph, r, members, readers) for r, members in enumerate(pieces)]
    return regions


def _readers(graph: Graph) -> dict[str, set[str]]:
    """Each value's reading ops; a graph output is read by the caller (``""``)."""
    readers: dict[str, set[str]] = {o: {""} for o in graph.outputs}
    for n in graph.ops:
        for x in n.inputs:
            readers.setdefault(x, set()).add(n.id)
    return readers


def _region(graph: Graph, index: int, members: Sequence[Node], readers: dict[str, set[str]]) -> Region:
    """``members`` (ops in order, every op they read from the graph before them) as a region: its outputs are the
    values read after it (ops are in topological order: a reader outside is a later one) or by the caller."""
    inside = {n.id for n in members}
    outputs = tuple(n.id for n in members if readers.get(n.id, set()) - inside)
    return _canonical(graph, index, list(members), inside, outputs)


def _repeat_cuts(graph: Graph, pieces: list[list[Node]], regions: list[Region],
                 readers: dict[str, set[str]]) -> list[list[Node]]:
    """The pieces, each region that occurs once cut in two where its first ops form another region with a GEMM
    and the rest holds none: the last layer of a model, which also holds the model's final norm (no GEMM reads
    the last residual sum, so no forced store ends that layer), then repeats the layers before it, and one
    region search serves them all. The cut stores the values live across it, which a plan of the whole piece
    might not; one region search fewer is worth it, and the other layers are cut there anyway."""
    counts = Counter(r.key for r in regions)
    sizes: dict[int, set[str]] = {}
    for r in regions:
        sizes.setdefault(len(r.ops), set()).add(r.key)
    out: list[list[Node]] = []
    for members, region in zip(pieces, regions, strict=True):
        out += _cut_at_repeat(graph, members, region, sizes, readers) if counts[region.key] == 1 else [members]
    return out


def _cut_at_repeat(graph: Graph, members: list[Node], region: Region, sizes: dict[int, set[str]],
                   readers: dict[str, set[str]]) -> list[list[Node]]:
    """``members`` as [another region's ops, the rest] where they start with another region's ops (the longest
    such region) that hold a GEMM or another op that reads its operands from memory (a search worth saving) and
    the rest holds none (a few ops, quickly searched), else as they are."""
    for size in sorted((s for s in sizes if 0 < s < len(members)), reverse=True):
        repeated, rest = members[:size], members[size:]
        if (any(n.op in _MEMORY_READERS for n in repeated) and not any(n.op in _MEMORY_READERS for n in rest)
                and _region(graph, region.index, repeated, readers).key in sizes[size]):
            return [repeated, rest]
    return [members]


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


def region_shares(regions: Sequence[Region], spec: DeviceSpec) -> dict[str, float]:
    """Each distinct region's share of the graph's estimated time (each unfused, as the cost model reckons them on
    ``spec``), its instances counted: by region key."""
    instances = Counter(r.key for r in regions)
    first = {r.key: r for r in reversed(regions)}
    times = {key: n * unfused_estimate_us(first[key].graph, spec) for key, n in instances.items()}
    total = sum(times.values())
    return {key: t / total if total > 0 else 1.0 for key, t in times.items()}


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

"""Our extractor: serialized e-graph -> candidate plans.

egglog's built-in extraction sums tree costs; the seed's kernel cost is not
additive (a max of memory and compute time, register sums with a spill cliff,
shared producers stored once), so plans are extracted here.

Vocabulary: a *stored* e-class holds a ``K`` node (and maybe ``CublasLt``
nodes) or an ``In`` node; a *value* e-class holds op nodes.  A kernel option
for a stored class is either a cuBLASLt node or a *body*: a choice of one op
node per value class, reached from the stored value through register children,
down to stored leaves.  A plan picks one option per stored class it needs,
starting from the graph outputs; a stored tensor read by several kernels is
written once, a register value used by several kernels is in each body and so
recomputed (and costed) in each.
"""

from __future__ import annotations

import bisect
import collections
import decimal
import itertools
import json
import logging
import random
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from planner.core.cost import DeviceSpec, KernelCost, kernel_cost
from planner.core.graph import Graph, TensorType
from planner.core.kinds import KernelKind, OpKind
from planner.core.ops import CUBLASLT_EPILOGUES, OPS
from planner.core.plans import Expr, Kernel, Load, Plan
from planner.core.report import Count
from planner.egraph.program import let_name

log = logging.getLogger(__name__)


class ExtractionError(RuntimeError):
    """The e-graph holds no valid plan (a rule bug, never bad user input)."""


@dataclass(frozen=True)
class ENode:
    op: str
    children: tuple[str, ...]  # e-class ids of Op-sorted children
    lits: tuple[Any, ...]  # literal arguments (attributes, names)


class Option:
    """One way to compute a stored class: a kernel.

    ``assign`` (value class -> chosen e-node index) is the body's own dict, shared and never
    mutated; the signature, which names the kernel across e-graphs, is built on first use (most
    options of a large graph are only ever costed)."""

    __slots__ = ("root", "kind", "assign", "leaves", "n_ops", "cost", "epilogue", "lt_args", "_sig", "_view")

    def __init__(
        self, root: str, kind: str, assign: dict[str, int], leaves: tuple[str, ...], n_ops: int, cost: KernelCost,
        *, sig: str | None = None, epilogue: str | None = None, lt_args: tuple[str, ...] = (),
        view: EGraphView | None = None,
    ) -> None:
        self.root, self.kind, self.assign, self.leaves, self.n_ops = root, kind, assign, leaves, n_ops
        self.cost, self.epilogue, self.lt_args, self._sig, self._view = cost, epilogue, lt_args, sig, view

    @property
    def sig(self) -> str:
        if self._sig is None:
            v = self._view
            assert v is not None, "a body option keeps its view"
            inner = sorted(v.value_node.get(c, c) for c in self.assign)
            self._sig = f"{self.kind}:{'+'.join(inner)}<{','.join(sorted(v.tensor[x] for x in self.leaves))}"
        return self._sig

    def __repr__(self) -> str:
        return f"Option({self.sig}, est {self.cost.est_us:.3f} us)"


@dataclass(slots=True)
class _Body:
    """A register-resident region: the chosen e-node of each value class, the stored classes it reads,
    and its ledger sums, kept as it grows so that costing it never walks it again."""

    assign: dict[str, int]
    leaves: frozenset[str]
    n_mm: int = 0
    n_red: int = 0  # row reductions: a row kernel, never a GEMM epilogue (whose tiles run elementwise)
    gemm: float = 0.0
    ew: float = 0.0
    regs: int = 0
    kind: str = KernelKind.ELEMENTWISE


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


# ---------------------------------------------------------------- options


@dataclass
class Extractor:
    graph: Graph
    view: EGraphView
    spec: DeviceSpec
    max_region_ops: int = 64
    max_bodies_per_root: int = 512
    options: dict[str, list[Option]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    neighbourhood: int = 8  # options per class tried by local search and mutation
    _bodies: dict[str, list[_Body]] = field(default_factory=dict)
    _uses: collections.Counter[str] = field(default_factory=collections.Counter)
    _rank: dict[str, list[Option]] | None = None
    _facts: dict[tuple[str, int], tuple[float, float, int, str]] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)
    _counts: dict[str, Decimal] | None = None
    _space: Count | None = None
    _by_sig: dict[str, Option] | None = None
    _weights: dict[str, list[Decimal]] | None = None  # per class: running sums of the plans below each option
    _names: dict[str, str] = field(default_factory=dict)  # value class -> the name its signature uses
    _kernels: dict[Option, Kernel] = field(default_factory=dict)  # built kernels, by option
    _unfused: dict[str, Option] | None = None
    _chain: bool | None = None
    _capped: dict[str, None] = field(default_factory=dict)  # values whose bodies the body cap cut, in order
    #: stored class -> the value class it stores (the child of its K node)
    _stored_value: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # each class's bodies are dropped once every e-node reading it has used them: they are the bulk of
        # the extractor's memory (a 64-op region cap gives a chain's node up to 64 bodies of up to 64 ops),
        # and a class asked for again after that is only computed again
        self._names = {c: self.view.value_node.get(c, c) for c in self.view.classes}
        self._stored_value = {s: n.children[0] for s in self.view.stored for n in self.view.classes[s] if n.op == "K"}
        self._uses = collections.Counter(c for nodes in self.view.classes.values() for n in nodes for c in n.children)
        for cls in sorted(self.view.stored - self.view.inputs, key=self.view.order.__getitem__):
            opts = self._options_for(cls)
            if not opts:
                raise ExtractionError(f"no kernel computes {self.view.tensor[cls]!r}")
            self.options[cls] = opts
        self._bodies.clear()
        if self._capped:  # one note: a deep graph reaches the cap at hundreds of values
            named = list(self._capped)
            more = f" (+{len(named) - CAPPED_NAMED} more)" if len(named) > CAPPED_NAMED else ""
            self.notes.append(f"body cap ({self.max_bodies_per_root}) reached at {len(named)} value(s): "
                              f"{', '.join(named[:CAPPED_NAMED])}{more}")

    def _used(self, c: str) -> None:
        self._uses[c] -= 1
        if self._uses[c] <= 0:
            self._bodies.pop(c, None)

    # -- bodies of a value class, as register-resident regions
    def _bodies_of(self, v: str) -> list[_Body]:
        if v in self._bodies:
            return self._bodies[v]
        self._bodies[v] = []  # cycle guard: a class reached through itself has no body
        out: list[_Body] = []
        stored = self.view.stored
        # the forms reading most children from registers first (and so each class's most fused body
        # first, and the first combination of the children's bodies the most fused one): where the cap
        # cuts a large DAG short, it drops mixed forms, never the most fused body; the one-op form
        # (every child from memory, the unfused kernel) is kept past the cap
        nodes = sorted(enumerate(self.view.classes.get(v, [])), key=lambda t: (sum(c in stored for c in t[1].children), t[0]))
        for idx, n in nodes:
            if n.op in ("K", "In", "CublasLt", "NoBias"):
                continue
            if n.op == "Opaque":
                if all(c in self.view.stored for c in n.children):
                    body = self._merge(v, idx, [_Body({}, frozenset(n.children))])
                    assert body is not None
                    out.append(body)
                continue
            per_child: list[list[_Body]] = []
            for c in n.children:
                if c in self.view.stored:
                    per_child.append([_Body({}, frozenset([c]))])
                else:
                    # an Opaque op is always its own kernel: never inlined into a consumer
                    subs = [b for b in self._bodies_of(c) if self.view.classes[c][b.assign[c]].op != "Opaque"]
                    per_child.append(subs)
            for c in n.children:
                self._used(c)
            for combo in itertools.product(*per_child):
                body = self._merge(v, idx, combo)
                if body is None or body.n_mm > 1 or (body.n_mm and body.n_red):
                    continue
                out.append(body)
                if len(out) >= self.max_bodies_per_root:
                    self._capped.setdefault(self.view.value_node.get(v, v))
                    break
            if len(out) >= self.max_bodies_per_root:
                break
        single = [(i, n) for i, n in nodes if n.op in OPS and n.op != "Opaque" and all(c in stored for c in n.children)]
        if single and not any(b.assign == {v: single[0][0]} for b in out):
            idx, n = single[0]
            body = self._merge(v, idx, [_Body({}, frozenset(n.children))])
            assert body is not None
            out.append(body)
        self._bodies[v] = out
        return out

    def _merge(self, v: str, idx: int, parts: Sequence[_Body]) -> _Body | None:
        """The body computing ``v`` with e-node ``idx`` over its children's bodies, or None when they
        choose one value two ways or it would exceed the region cap.  The largest part's dict is copied
        and the rest checked against it: a chain's body grows by one entry, not by a walk."""
        g, e, r, op_kind = self._node_facts(v, idx)
        if len(parts) == 1 and parts[0].assign and v not in parts[0].assign:  # a chain: one child in registers
            p = parts[0]
            if len(p.assign) >= self.max_region_ops or self._loads_own(p.leaves, (v,)):
                return None
            assign = p.assign.copy()
            assign[v] = idx
            return _Body(assign, p.leaves, p.n_mm + (op_kind == OpKind.MATMUL), p.n_red + (op_kind == OpKind.REDUCTION),
                         p.gemm + g, p.ew + e, p.regs + r, _KERNEL_OF_OP.get(op_kind, p.kind))
        bodies = [p for p in parts if p.assign]
        n_mm = (op_kind == OpKind.MATMUL) + sum(p.n_mm for p in parts)
        n_red = (op_kind == OpKind.REDUCTION) + sum(p.n_red for p in parts)
        if bodies:
            big = max(bodies, key=lambda p: len(p.assign))
            if len(big.assign) + (v not in big.assign) > self.max_region_ops:
                return None
            assign = dict(big.assign)
            gemm, ew, regs, kind = big.gemm, big.ew, big.regs, big.kind
            for p in bodies:
                if p is big:
                    continue
                for c, i in p.assign.items():
                    j = assign.get(c)
                    if j is None:
                        assign[c] = i
                        cg, ce, cr, c_kind = self._node_facts(c, i)
                        gemm, ew, regs, kind = gemm + cg, ew + ce, regs + cr, _KERNEL_OF_OP.get(c_kind, kind)
                    elif j != i:
                        return None  # one value computed two ways in one kernel
            if len(assign) + (v not in assign) > self.max_region_ops:
                return None
        else:
            assign, gemm, ew, regs, kind = {}, 0.0, 0.0, 0, KernelKind.ELEMENTWISE
        j = assign.get(v)
        if j is not None and j != idx:
            return None
        if j is None:
            assign[v] = idx
            gemm, ew, regs, kind = gemm + g, ew + e, regs + r, _KERNEL_OF_OP.get(op_kind, kind)
        leaves = parts[0].leaves if len(parts) == 1 else frozenset[str]().union(*(p.leaves for p in parts))
        if self._loads_own(leaves, assign):
            return None
        return _Body(assign, leaves, n_mm, n_red, gemm, ew, regs, kind)

    def _loads_own(self, leaves: frozenset[str], computed: Collection[str]) -> bool:
        """Would a kernel computing ``computed`` in registers also read one of them from memory? Never a better
        kernel than the one using its register value throughout, and not the same numbers: ``x - x`` reading one
        operand stored in fp16 and the other in fp32 registers is the store's rounding error, not zero."""
        return any(self._stored_value.get(leaf) in computed for leaf in leaves)

    def _options_for(self, cls: str) -> list[Option]:
        opts: dict[Any, Option] = {}
        names = self._names
        for n in self.view.classes[cls]:
            if n.op == "K":
                for body in self._bodies_of(n.children[0]):
                    o = self._body_option(cls, body)
                    # the signature's content: e-node variants over the same values and reads are one kernel
                    opts.setdefault((o.kind, frozenset(map(names.__getitem__, o.assign)), o.leaves), o)
                self._used(n.children[0])
            elif n.op == "CublasLt":
                lib = self._cublaslt_option(cls, n)
                if lib is not None:
                    opts.setdefault(lib.sig, lib)
        return _cheapest_first(list(opts.values()), lambda o: o.cost.est_us)

    def _node_facts(self, c: str, i: int) -> tuple[float, float, int, str]:
        """(GEMM FLOPs, elementwise FLOPs, live registers, op kind) of one e-node."""
        key = (c, i)
        facts = self._facts.get(key)
        if facts is None:
            v = self.view
            n = v.classes[c][i]
            opd = OPS[n.op]
            attrs = self._attrs(n, v.value_node.get(c, ""))
            f = opd.flops(v.types[c].shape, [v.types[k].shape for k in n.children], attrs)
            gemm, ew = (f, 0.0) if opd.kind in (OpKind.MATMUL, OpKind.STANDALONE) else (0.0, f)
            facts = (gemm, ew, opd.live_regs(attrs), opd.kind)
            self._facts[key] = facts
        return facts

    def _body_option(self, cls: str, body: _Body) -> Option:
        v = self.view
        leaves = tuple(sorted(body.leaves, key=v.order.__getitem__))
        nbytes = sum(self._nbytes(leaf) for leaf in leaves) + self._nbytes(cls)
        cost = kernel_cost(
            self.spec, kind=body.kind, dtype=v.types[cls].dtype, nbytes=nbytes, gemm_flops=body.gemm,
            ew_flops=body.ew, regs=body.regs,
        )
        return Option(cls, body.kind, body.assign, leaves, len(body.assign), cost, view=v)

    def _cublaslt_option(self, cls: str, n: ENode) -> Option | None:
        v = self.view
        a, b, bias = n.children
        (epilogue,) = n.lits
        if epilogue not in CUBLASLT_EPILOGUES:
            self._note(f"unknown cuBLASLt epilogue {epilogue!r} ignored")
            return None
        has_bias = any(x.op != "NoBias" for x in v.classes.get(bias, []))
        args = (a, b, bias) if has_bias else (a, b)
        if not all(x in v.stored for x in args):
            self._note(f"cuBLASLt node for {v.tensor[cls]!r} reads a non-stored operand; ignored")
            return None
        out = v.types[cls]
        (m, k), (_, nn) = v.types[a].shape, v.types[b].shape
        epi_ops = CUBLASLT_EPILOGUES[epilogue]
        ew = sum(OPS[o].flops(out.shape, [out.shape], {}) for o in epi_ops)
        leaves = tuple(sorted(set(args), key=v.order.__getitem__))
        nbytes = sum(v.types[x].nbytes for x in leaves) + out.nbytes
        regs = OPS["MatMul"].live_regs({})
        cost = kernel_cost(
            self.spec, kind=KernelKind.CUBLASLT, dtype=out.dtype, nbytes=nbytes, gemm_flops=2.0 * m * nn * k, ew_flops=ew, regs=regs
        )
        sig = f"cublaslt({epilogue})<{','.join(v.tensor[x] for x in args)}"
        return Option(cls, KernelKind.CUBLASLT, {}, leaves, 1 + len(epi_ops), cost, sig=sig, epilogue=epilogue,
                      lt_args=args)

    def _nbytes(self, cls: str) -> int:
        n = self._bytes.get(cls)
        if n is None:
            n = self._bytes[cls] = self.view.types[cls].nbytes
        return n

    def _note(self, msg: str) -> None:
        if msg not in self.notes:
            self.notes.append(msg)
            log.info("%s", msg)

    def _attrs(self, n: ENode, node_id: str) -> dict[str, Any]:
        if n.op == "Opaque":
            return self.graph[n.lits[1]].attr_dict
        return {a.name: lit for a, lit in zip(OPS[n.op].attrs, n.lits, strict=True)}

    # ------------------------------------------------------------ plans

    def required(self, choice: dict[str, Option]) -> list[str]:
        """Stored classes a choice needs, outputs first, as reached from the roots."""
        need: list[str] = []
        seen: set[str] = set()
        stack = [r for r in self.view.roots if r not in self.view.inputs]
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            need.append(c)
            stack.extend(x for x in choice[c].leaves if x not in self.view.inputs)
        return need

    def plan_of(self, choice: dict[str, Option]) -> Plan:
        used = sorted(self.required(choice), key=self.view.order.__getitem__)
        kernels = tuple(self._kernel(choice[c]) for c in used)
        if self._chain is None:
            self._chain = self.graph.is_chain()
        partition = tuple(choice[c].n_ops for c in used) if self._chain else None
        key = ";".join(choice[c].sig for c in used)
        tensors = {n.id: n.type for n in self.graph.nodes}
        outs = tuple(self.view.tensor[r] for r in self.view.roots)
        return Plan(self.graph.name, kernels, outs, tensors, key, partition)

    def _kernel(self, o: Option) -> Kernel:
        """The kernel of an option, built once: a search's plans share most of their kernels."""
        k = self._kernels.get(o)
        if k is None:
            k = self._kernels[o] = self._build_kernel(o)
        return k

    def _build_kernel(self, o: Option) -> Kernel:
        v = self.view
        out_name = v.tensor[o.root]
        body = self._cublaslt_body(o) if o.kind == KernelKind.CUBLASLT else self._expr(self._k_child(o.root), o.assign, {})
        reads = tuple(v.tensor[x] for x in o.leaves)
        return Kernel(o.kind, body, out_name, reads, o.cost, o.epilogue)

    def _k_child(self, cls: str) -> str:
        for n in self.view.classes[cls]:
            if n.op == "K":
                return n.children[0]
        raise ExtractionError(f"stored class {cls} has no K node")

    def _expr(self, v: str, assign: dict[str, int], memo: dict[str, Expr]) -> Expr:
        if v in memo:
            return memo[v]
        n = self.view.classes[v][assign[v]]
        node_id = self.view.value_node.get(v, "")
        args: list[Expr | Load] = []
        for c in n.children:
            if c in assign:
                args.append(self._expr(c, assign, memo))
            else:
                args.append(Load(self.view.tensor[c]))
        attrs = self._attrs(n, node_id)
        e = Expr(n.op, tuple(args), tuple(sorted(attrs.items())), node_id, self.view.types[v])
        memo[v] = e
        return e

    def _cublaslt_body(self, o: Option) -> Expr:
        v = self.view
        assert o.epilogue is not None
        a, b = o.lt_args[0], o.lt_args[1]
        out_t = v.types[o.root]
        node_id = v.tensor[o.root]
        e: Expr = Expr("MatMul", (Load(v.tensor[a]), Load(v.tensor[b])), (), node_id + ".gemm", out_t)
        for op in CUBLASLT_EPILOGUES[o.epilogue]:
            args: tuple[Expr | Load, ...] = (e, Load(v.tensor[o.lt_args[2]])) if op == "BiasAdd" else (e,)
            e = Expr(op, args, (), f"{node_id}.{op.lower()}", out_t)
        return Expr(e.op, e.args, e.attrs, node_id, out_t)

    # ------------------------------------------------------------ search over plans

    def unfused(self) -> dict[str, Option]:
        """One kernel per op of the graph: every value read from memory, no library calls; each class computed
        by its graph node's own op where the class has it (a rule may have made another single op equal to it:
        ``x * sigmoid(x)`` is ``Silu(x)``, which would skip the node of the sigmoid)."""
        if self._unfused is None:
            choice: dict[str, Option] = {}
            for c, opts in self.options.items():
                singles = [o for o in opts if o.kind != KernelKind.CUBLASLT and o.n_ops == 1]
                if not singles:
                    raise ExtractionError(f"no single-op kernel for {self.view.tensor[c]!r}")
                own = self.graph[self.view.tensor[c]].op
                choice[c] = next((o for o in singles if self._root_op(o) == own), singles[0])
            self._unfused = choice
        return dict(self._unfused)

    def _root_op(self, o: Option) -> str:
        """The op of a one-op kernel's e-node."""
        ((cls, i),) = o.assign.items()
        return self.view.classes[cls][i].op

    def enumerate(self, cap: int) -> tuple[list[dict[str, Option]], bool]:
        """All plans if there are at most ``cap``; returns (plans, complete).  Depth-first over the stored
        classes a choice needs, latest first, with an explicit stack (a segment of 1,000 graph outputs is
        1,000 levels deep)."""
        out: list[dict[str, Option]] = []
        order, inputs = self.view.order, self.view.inputs
        chosen: dict[str, Option] = {}
        frames: list[list[Any]] = []  # [class, classes still pending after it, next option to try]

        def descend(pending: list[str]) -> bool:
            """A plan when nothing is pending (False once there are more than ``cap``), else a new level."""
            if not pending:
                out.append(dict(chosen))
                return len(out) <= cap
            pending = sorted(pending, key=order.__getitem__)
            frames.append([pending.pop(), pending, 0])
            return True

        complete = descend([r for r in dict.fromkeys(self.view.roots) if r not in inputs])
        while frames and complete:
            frame = frames[-1]
            r, pending, i = frame
            chosen.pop(r, None)
            if i == len(self.options[r]):
                frames.pop()
                continue
            o = self.options[r][i]
            frame[2] = i + 1
            new = [x for x in o.leaves if x not in inputs and x not in chosen and x not in pending]
            chosen[r] = o
            complete = descend(pending + new)
        if not complete:
            out.pop()
        return out, complete

    def _shared(self) -> set[str]:
        """Stored classes read by two or more graph ops: their choice is counted once."""
        uses: dict[str, int] = {}
        for node in self.graph.nodes:
            for i in set(node.inputs):
                uses[i] = uses.get(i, 0) + 1
        return {c for c in self.options if uses.get(self.view.tensor[c], 0) > 1}

    def _local_counts(self) -> dict[str, Decimal]:
        if self._counts is not None:
            return self._counts
        shared = self._shared()
        count: dict[str, Decimal] = {}
        for c in sorted(self.options, key=self.view.order.__getitem__):
            count[c] = _total(
                _prod(count[x] for x in o.leaves if x in count and x not in shared) for o in self.options[c]
            )
        self._counts = count
        return count

    def space_size(self) -> Count:
        """Number of plans: exact for chains and trees up to 10^34 (then to 34 digits); with shared
        producers an estimate that counts each shared producer's choice once."""
        if self._space is None:
            count = self._local_counts()
            roots = {r for r in self.view.roots if r not in self.view.inputs} | self._shared()
            total = _prod(count[r] for r in roots)
            self._space = _as_int(total) if total < _EXACT else total
        return self._space

    def cost(self, choice: dict[str, Option]) -> float:
        return sum(choice[c].cost.est_us for c in self.required(choice))

    def _ranked(self) -> dict[str, list[Option]]:
        """Each class's options by tree-DP value: own time plus the best times of its inputs
        (shared producers counted per use)."""
        if self._rank is None:
            best: dict[str, float] = {}
            ranked: dict[str, list[Option]] = {}
            for c in sorted(self.options, key=self.view.order.__getitem__):
                value = {o: o.cost.est_us + sum(best[x] for x in o.leaves if x in best) for o in self.options[c]}
                ranked[c] = _cheapest_first(self.options[c], value.__getitem__)
                best[c] = value[ranked[c][0]]
            self._rank = ranked
        return self._rank

    def dp_best(self) -> dict[str, Option]:
        """Tree DP on estimated time, then exact local search."""
        choice = {c: opts[0] for c, opts in self._ranked().items()}
        return self.improve(choice)

    def improve(self, choice: dict[str, Option], max_passes: int = 4) -> dict[str, Option]:
        """Greedy local search with exact plan costs: swap one kernel while it helps,
        trying each class's ``neighbourhood`` best options by DP value."""
        current = dict(choice)
        cur_cost = self.cost(current)
        for _ in range(max_passes):
            changed = False
            for trial in list(self.neighbours(current)):
                t_cost = self.cost(trial)
                if t_cost < cur_cost - 1e-9:
                    current, cur_cost, changed = trial, t_cost, True
            if not changed:
                break
        return current

    def sample(self, n: int, seed: int) -> list[dict[str, Option]]:
        """Seeded, deduplicated samples; uniform over plans when they form trees."""
        rng = random.Random(seed)
        if self._weights is None:
            count = self._local_counts()
            shared = self._shared()
            self._weights = {
                c: list(itertools.accumulate((_prod(count[x] for x in o.leaves if x in count and x not in shared)
                                              for o in opts), _COUNTS.add))
                for c, opts in self.options.items()
            }
        weights = self._weights
        seen: set[str] = set()
        out: list[dict[str, Option]] = []
        attempts = 0
        total = self.space_size()
        base = self.unfused()
        while len(out) < min(n, total) and attempts < 20 * n:
            attempts += 1
            choice = dict(base)
            pending = [r for r in dict.fromkeys(self.view.roots) if r not in self.view.inputs]
            done: set[str] = set()
            while pending:
                pending.sort(key=self.view.order.__getitem__)
                r = pending.pop()
                if r in done:
                    continue
                done.add(r)
                o = self.options[r][_weighted_index(rng, weights[r])]
                choice[r] = o
                pending.extend(x for x in o.leaves if x not in self.view.inputs and x not in done)
            key = self.key(choice)
            if key not in seen:
                seen.add(key)
                out.append(choice)
        return out

    def key(self, choice: dict[str, Option]) -> str:
        used = sorted(self.required(choice), key=self.view.order.__getitem__)
        return ";".join(choice[c].sig for c in used)

    def choice_from_kernels(self, kernels: Sequence[Kernel]) -> dict[str, Option] | None:
        """The choice whose kernels are these (by signature), completed with unfused
        kernels; None when some kernel has no matching option in this e-graph."""
        if self._by_sig is None:
            self._by_sig = {o.sig: o for opts in self.options.values() for o in opts}
        choice = dict(self.unfused())
        for k in kernels:
            o = self._by_sig.get(kernel_sig(k))
            if o is None:
                log.debug("no option matches kernel %s", k.describe())
                return None
            choice[o.root] = o
        return choice

    def neighbours(self, choice: dict[str, Option]) -> Iterator[dict[str, Option]]:
        """Plans that differ in one kernel, among each class's best options by DP value."""
        ranked = self._ranked()
        for c in sorted(self.required(choice), key=self.view.order.__getitem__):
            for o in ranked[c][: self.neighbourhood]:
                if o is not choice[c]:
                    trial = dict(choice)
                    trial[c] = o
                    yield trial


def kernel_sig(k: Kernel) -> str:
    """The signature of the option a kernel was built from (see ``Extractor._body_option``)."""
    if k.kind == KernelKind.CUBLASLT:
        args: list[str] = []
        for e in k.body.walk():
            args += [a.tensor for a in e.args if isinstance(a, Load)]
        return f"cublaslt({k.epilogue})<{','.join(args)}"
    inner = sorted(e.node for e in k.body.walk())
    return f"{k.kind}:{'+'.join(inner)}<{','.join(sorted(k.reads))}"


#: the kernel kind of a body holding an op of this kind (a body holds at most one op that is not
#: elementwise or a reduction: the extractor's rules)
_KERNEL_OF_OP: dict[str, str] = {OpKind.MATMUL: KernelKind.GEMM_EPILOGUE, OpKind.OPAQUE: KernelKind.OPAQUE,
                 OpKind.STANDALONE: KernelKind.STANDALONE}


def _cheapest_first(options: list[Option], value: Callable[[Option], float]) -> list[Option]:
    """Options by ``value``; ties (a chain's bodies all read and write the same bytes) the more fused
    first, then by signature, built only for those still tied."""
    out = sorted(options, key=lambda o: (value(o), -o.n_ops))
    i = 0
    while i < len(out):
        j = i + 1
        while j < len(out) and value(out[j]) == value(out[i]) and out[j].n_ops == out[i].n_ops:
            j += 1
        if j - i > 1:
            out[i:j] = sorted(out[i:j], key=lambda o: o.sig)
        i = j
    return out


#: values a body-cap note names
CAPPED_NAMED = 4

#: plan counts: exact below 10^34, then rounded to 34 digits. A graph of a few hundred ops has 10^1000
#: plans and more; exact integers of that size made their products the extractor's largest cost
#: (a 6-layer transformer: 40 s of 47)
_COUNTS = decimal.Context(prec=34, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
_EXACT = Decimal(10) ** 34


def _prod(xs: Iterator[Decimal] | Sequence[Decimal] | Any) -> Decimal:
    out = Decimal(1)
    for x in xs:
        out = _COUNTS.multiply(out, x)
    return out


def _as_int(count: Decimal) -> int:
    """``int(count)`` of an exact count (Decimal's own conversion took 3.5 s for one of 10^288,000)."""
    _, digits, exponent = count.as_tuple()
    assert isinstance(exponent, int)  # a count is finite
    value = int("".join(map(str, digits)))
    return value * 10**exponent if exponent >= 0 else value // 10**-exponent


def _total(xs: Iterator[Decimal] | Any) -> Decimal:
    out = Decimal(0)
    for x in xs:
        out = _COUNTS.add(out, x)
    return out


def _weighted_index(rng: random.Random, cumulative: list[Decimal]) -> int:
    """An index drawn with probability proportional to its weight, from the running sums of the weights:
    exactly while the counts are exact, else from a uniform float."""
    total = cumulative[-1]
    draw = Decimal(rng.randrange(_as_int(total))) if total < _EXACT else _COUNTS.multiply(total, Decimal(rng.random()))
    return min(bisect.bisect_right(cumulative, draw), len(cumulative) - 1)

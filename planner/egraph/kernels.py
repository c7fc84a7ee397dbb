"""Kernel options: every way to compute each stored class as one kernel (a body of register values down to stored
leaves, or a cuBLASLt call), costed on the three ledgers, and the kernels a chosen option builds."""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.core.cost import DeviceSpec, KernelCost, kernel_cost
from planner.core.graph import Graph
from planner.core.kinds import KERNEL_OF_OP, KernelKind, OpKind
from planner.core.ops import CUBLASLT_EPILOGUES, OPS
from planner.core.plans import Expr, Kernel, Load
from planner.egraph.view import EGraphView, ENode, ExtractionError

log = logging.getLogger(__name__)

#: values a body-cap note names
CAPPED_NAMED = 4


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
class Body:
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
class KernelOptions:
    """The kernel options of every stored class of an e-graph view (built when the object is made), and the
    kernels they build."""

    graph: Graph
    view: EGraphView
    spec: DeviceSpec
    max_region_ops: int = 64
    max_bodies_per_root: int = 512
    options: dict[str, list[Option]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _bodies: dict[str, list[Body]] = field(default_factory=dict)
    _uses: collections.Counter[str] = field(default_factory=collections.Counter)
    _facts: dict[tuple[str, int], tuple[float, float, int, str]] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)
    _names: dict[str, str] = field(default_factory=dict)  # value class -> the name its signature uses
    _kernels: dict[Option, Kernel] = field(default_factory=dict)  # built kernels, by option
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

    def _bodies_of(self, v: str) -> list[Body]:
        if v in self._bodies:
            return self._bodies[v]
        self._bodies[v] = []  # cycle guard: a class reached through itself has no body
        out: list[Body] = []
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
                    body = self._merge(v, idx, [Body({}, frozenset(n.children))])
                    assert body is not None
                    out.append(body)
                continue
            per_child: list[list[Body]] = []
            for c in n.children:
                if c in self.view.stored:
                    per_child.append([Body({}, frozenset([c]))])
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
            body = self._merge(v, idx, [Body({}, frozenset(n.children))])
            assert body is not None
            out.append(body)
        self._bodies[v] = out
        return out

    def _merge(self, v: str, idx: int, parts: Sequence[Body]) -> Body | None:
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
            return Body(assign, p.leaves, p.n_mm + (op_kind == OpKind.MATMUL), p.n_red + (op_kind == OpKind.REDUCTION),
                         p.gemm + g, p.ew + e, p.regs + r, KERNEL_OF_OP.get(op_kind, p.kind))
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
                        gemm, ew, regs, kind = gemm + cg, ew + ce, regs + cr, KERNEL_OF_OP.get(c_kind, kind)
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
            gemm, ew, regs, kind = gemm + g, ew + e, regs + r, KERNEL_OF_OP.get(op_kind, kind)
        leaves = parts[0].leaves if len(parts) == 1 else frozenset[str]().union(*(p.leaves for p in parts))
        if self._loads_own(leaves, assign):
            return None
        return Body(assign, leaves, n_mm, n_red, gemm, ew, regs, kind)

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
        return cheapest_first(list(opts.values()), lambda o: o.cost.est_us)

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

    def _body_option(self, cls: str, body: Body) -> Option:
        v = self.view
        leaves = tuple(sorted(body.leaves, key=v.order.__getitem__))
        gathered = self._gathered_reads(body) if body.kind == KernelKind.STANDALONE else {}
        nbytes = sum(gathered.get(leaf, self._nbytes(leaf)) for leaf in leaves) + self._nbytes(cls)
        cost = kernel_cost(
            self.spec, kind=body.kind, dtype=v.types[cls].dtype, nbytes=nbytes, gemm_flops=body.gemm,
            ew_flops=body.ew, regs=body.regs, out_shape=v.types[cls].shape,
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

    def _gathered_reads(self, body: Body) -> dict[str, int]:
        """The bytes read of each leaf that the body reads only as a gather's table: the rows its gathers hold."""
        v = self.view
        rows: dict[str, int] = {}
        whole: set[str] = set()
        for c, i in body.assign.items():
            n = v.classes[c][i]
            opd = OPS[n.op]
            for j, child in enumerate(n.children):
                if j in opd.gathered:
                    rows[child] = opd.read_bytes(j, self._nbytes(child), self._nbytes(c)) + rows.get(child, 0)
                else:
                    whole.add(child)
        return {leaf: min(b, self._nbytes(leaf)) for leaf, b in rows.items() if leaf not in whole}

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


def kernel_sig(k: Kernel) -> str:
    """The signature of the option a kernel was built from (see ``Extractor._body_option``)."""
    if k.kind == KernelKind.CUBLASLT:
        args: list[str] = []
        for e in k.body.walk():
            args += [a.tensor for a in e.args if isinstance(a, Load)]
        return f"cublaslt({k.epilogue})<{','.join(args)}"
    inner = sorted(e.node for e in k.body.walk())
    return f"{k.kind}:{'+'.join(inner)}<{','.join(sorted(k.reads))}"


def cheapest_first(options: list[Option], value: Callable[[Option], float]) -> list[Option]:
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


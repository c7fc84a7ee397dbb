"""Plans: ordered lists of kernels, each with a body, its tensors and ledgers.

A kernel body is an expression tree over the op table.  Its leaves are
:class:`Load` s of tensors in memory (graph inputs or other kernels' outputs);
every inner :class:`Expr` is computed in registers; the root is stored once.
A ``cublaslt`` kernel's body is the op tree its epilogue means, so every
executor evaluates all kernels the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from planner.core import limits
from planner.core.cost import KernelCost
from planner.core.graph import Graph, TensorType
from planner.core.kinds import KernelKind
from planner.core.ops import OpError, op_def

KERNEL_KINDS = tuple(KernelKind)


@dataclass(frozen=True)
class Load:
    """Read a whole tensor from memory."""

    tensor: str


@dataclass(frozen=True)
class Expr:
    """One op computed in registers; ``node`` is the graph node whose value it is."""

    op: str
    args: tuple[Expr | Load, ...]
    attrs: tuple[tuple[str, Any], ...]
    node: str
    type: TensorType

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def walk(self) -> Iterator[Expr]:
        """Distinct inner nodes, producers before consumers."""
        seen: set[int] = set()
        order: list[Expr] = []

        def visit(e: Expr) -> None:
            if id(e) in seen:
                return
            seen.add(id(e))
            for a in e.args:
                if isinstance(a, Expr):
                    visit(a)
            order.append(e)

        visit(self)
        return iter(order)


def abbreviate(parts: list[str], sep: str, limit: int | None) -> str:
    """``parts`` joined by ``sep``; past ``limit`` of them, the first ``limit`` and how many more."""
    if limit is None or len(parts) <= limit:
        return sep.join(parts)
    return sep.join(parts[:limit]) + f"{sep}...{len(parts) - limit:,} more"


@dataclass(frozen=True)
class Kernel:
    kind: str  # one of KERNEL_KINDS
    body: Expr
    out: str  # the tensor it writes
    reads: tuple[str, ...]  # tensors it reads, each once
    cost: KernelCost
    epilogue: str | None = None  # cuBLASLt epilogue name
    #: facts from a compiled kernel (regs, spill_bytes, occupancy), where known
    facts: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def ops(self) -> tuple[str, ...]:
        """Op names, producers first; an Opaque op shows its implementation."""
        return tuple(e.op if e.op != "Opaque" else f"Opaque:{e.attr_dict['impl']}" for e in self.body.walk())

    @property
    def label(self) -> str:
        if self.kind == KernelKind.CUBLASLT:
            return f"cublaslt({self.epilogue})"
        return self.kind

    def describe(self, limit: int | None = None) -> str:
        """``label[op+op+...]``; with ``limit``, at most that many ops named (for tables of long kernels)."""
        return f"{self.label}[{abbreviate(list(self.ops), '+', limit)}]"


@dataclass(frozen=True)
class Plan:
    graph: str
    kernels: tuple[Kernel, ...]
    outputs: tuple[str, ...]  # tensor holding each graph output, in graph order
    tensors: dict[str, TensorType] = field(compare=False, hash=False)
    key: str = ""
    partition: tuple[int, ...] | None = None

    @property
    def bytes(self) -> int:
        return sum(k.cost.bytes for k in self.kernels)

    @property
    def launches(self) -> int:
        return sum(k.cost.launches for k in self.kernels)

    @property
    def reg_peak(self) -> int:
        return max((k.cost.regs for k in self.kernels), default=0)

    @property
    def est_us(self) -> float:
        return sum(k.cost.est_us for k in self.kernels)

    @property
    def flops(self) -> float:
        return sum(k.cost.flops for k in self.kernels)

    def notation(self, limit: int | None = None) -> str:
        """The chain partition ``[2,3]`` or the kernels ``{...}``; with ``limit``, abbreviated past that many
        parts (what a person reads; files and logs keep the whole)."""
        if self.partition is not None:
            return "[" + abbreviate([str(p) for p in self.partition], ",", limit) + "]"
        return "{" + abbreviate([k.describe(limit) for k in self.kernels], " ; ", limit) + "}"

    def composition(self) -> str:
        """Kernel composition, e.g. ``elementwise:2, cublaslt(GELU_BIAS):1``."""
        counts: dict[str, int] = {}
        for k in self.kernels:
            counts[k.label] = counts.get(k.label, 0) + 1
        return ", ".join(f"{label}:{n}" for label, n in counts.items())

    def sort_key(self) -> tuple[Any, ...]:
        """Deterministic order: estimated time, then launches, register peak, partition."""
        return (
            round(self.est_us, 6),
            self.launches,
            self.reg_peak,
            self.partition or (),
            self.key,
        )

    def kernel_json(self, k: Kernel) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": k.kind,
            "ops": list(k.ops),
            "reads": list(k.reads),
            "writes": k.out,
            "bytes": k.cost.bytes,
            "flops": k.cost.flops,
            "regs": k.cost.regs,
            "spills": k.cost.spills,
            "est_us": round(k.cost.est_us, 4),
        }
        if k.epilogue is not None:
            d["epilogue"] = k.epilogue
        d.update(k.facts)
        return d

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.notation(),
            "partition": list(self.partition) if self.partition is not None else None,
            "kernels": [self.kernel_json(k) for k in self.kernels],
            "bytes": self.bytes,
            "launches": self.launches,
            "reg_peak": self.reg_peak,
            "est_us": round(self.est_us, 4),
        }


# ---------------------------------------------------------------- body JSON


def expr_to_json(e: Expr | Load) -> dict[str, Any]:
    if isinstance(e, Load):
        return {"load": e.tensor}
    d: dict[str, Any] = {"op": e.op, "node": e.node, "shape": list(e.type.shape), "dtype": e.type.dtype}
    if e.attrs:
        d["attrs"] = dict(e.attrs)
    d["args"] = [expr_to_json(a) for a in e.args]
    return d


def expr_from_json(d: Any, where: str = "body") -> Expr | Load:
    """Rebuild a body; validates structure but does not trust it (no code is loaded).

    JSON writes a shared value (a row mean that both the centring and the variance read) once per use;
    equal nodes come back as one object, as the extractor built them, so a generator that emits each
    object once computes the value once."""
    max_depth = limits.current().depth
    try:
        return _expr_from_json(d, where, {}, max_depth)
    except _TooDeep:
        raise ValueError(f"{where}: nests deeper than {max_depth} levels ({limits.flag_of('depth')})") from None


class _TooDeep(Exception):
    pass


def _expr_from_json(d: Any, where: str, shared: dict[tuple[Any, ...], Expr], depth_left: int) -> Expr | Load:
    if depth_left < 1:
        raise _TooDeep
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected an object")
    if "load" in d:
        if not isinstance(d["load"], str):
            raise ValueError(f"{where}: 'load' must be a tensor name")
        return Load(d["load"])
    op = d.get("op")
    if not isinstance(op, str):
        raise ValueError(f"{where}: missing 'op'")
    opd = op_def(op)
    raw_attrs, raw_args = d.get("attrs", {}), d.get("args", [])
    if not isinstance(raw_attrs, dict) or not isinstance(raw_args, list):
        raise ValueError(f"{where}: {op} needs 'attrs' as an object and 'args' as a list")
    try:
        attrs = opd.check_attrs(raw_attrs)
    except OpError as exc:
        raise OpError(f"node {d.get('node')!r}: {exc}") from None
    parts = []
    for a in raw_args:  # a loop, not a generator: one Python frame a level
        parts.append(_expr_from_json(a, f"{where}.{op}", shared, depth_left - 1))
    args = tuple(parts)
    shape = d.get("shape")
    dtype = d.get("dtype")
    if (not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)
            or not isinstance(dtype, str)):
        raise ValueError(f"{where}: {op} needs 'shape' (a list of non-negative integers) and 'dtype'")
    e = Expr(op, args, tuple(sorted(attrs.items())), str(d.get("node", "")), TensorType(tuple(shape), dtype))
    # the arguments are already shared objects: their identities (and the loads' names) key the node
    key = (op, tuple(a.tensor if isinstance(a, Load) else id(a) for a in args), e.attrs, e.node, e.type)
    return shared.setdefault(key, e)


# ---------------------------------------------------------------- renaming and composing


def compose_plan(graph: Graph, kernels: list[Kernel], key: str) -> Plan:
    """A plan over ``graph`` from kernels already named in its ids (regions renamed back)."""
    tensors = {n.id: n.type for n in graph.nodes}
    partition = tuple(len(kk.ops) for kk in kernels) if graph.is_chain() else None
    return Plan(graph.name, tuple(kernels), tuple(graph.outputs), tensors, key, partition)


def _rename(name: str, names: dict[str, str]) -> str:
    """Rename a tensor or node name; ``name.suffix`` (a cuBLASLt body's inner node) keeps its suffix."""
    if name in names:
        return names[name]
    head, dot, tail = name.rpartition(".")
    return names[head] + dot + tail if dot and head in names else name


def rename_expr(e: Expr | Load, names: dict[str, str], memo: dict[int, Expr]) -> Expr | Load:
    if isinstance(e, Load):
        return Load(_rename(e.tensor, names))
    if id(e) in memo:
        return memo[id(e)]
    out = replace(e, args=tuple(rename_expr(a, names, memo) for a in e.args), node=_rename(e.node, names))
    memo[id(e)] = out
    return out


def rename_kernel(k: Kernel, names: dict[str, str]) -> Kernel:
    body = rename_expr(k.body, names, {})
    assert isinstance(body, Expr)
    return replace(k, body=body, out=_rename(k.out, names), reads=tuple(_rename(r, names) for r in k.reads))

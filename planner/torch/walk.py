"""The importer's walk over a traced graph: values during import, materialising them as IR tensors, and the calls
that have no lowering of their own (kept as torch-backed Opaque steps). Each mapped torch call is a lowering of
:mod:`planner.torch.lowerings`, handed in as a registry."""

from __future__ import annotations

import json
import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from planner.core.graph import GraphBuilder, GraphError
from planner.core.inputs import INDEX_STEP
from planner.core.kinds import OpKind
from planner.core.opaque import flat_shape, step_flops
from planner.core.ops import OPS, OpError
from planner.torch.binding import INDEX_DTYPES, TORCH_DTYPES, Binding, OutputSpec, ir_dtype, to_numpy
from planner.torch.errors import TorchImportError
from planner.torch.heads import column_take, head_merge, head_split, regrouped, rotate_half, rows_to_heads
from planner.torch.ops import IMPORTER_TABLE, encode_arg, resolve_torch_fn, torch_fn_name, trust_traced
from planner.torch.tracing import BATCH_NORMS, INPLACE_OPERATORS, mutated_input_of, written_inputs

log = logging.getLogger(__name__)

#: the layout of an image batch (N, C, *pixels) stored as (N*pixels, C) rows
CHANNELS_LAST = "channels_last"
#: kinds whose lowerings take channels-last values as they are (any other lowering, a torch call, an output,
#: sees the value in torch's order: ``Importer.plain``)
LAYOUT_KINDS = frozenset({"conv", "batch_norm", "max_pool", "avg_pool", "mean", "relu", "silu", "gelu", "add",
                          "sub", "mul", "div", "maximum", "minimum", "same", "dropout", "view", "clamp",
                          "leaky_relu", "hardswish", "hardsigmoid", "permute", "avg_pool_window"})

#: kinds whose lowerings take integer inputs (token ids): a view of them, the embedding that reads them
INDEX_KINDS = frozenset({"view", "same", "embedding"})
#: kinds whose lowering reads a bool mask torch computes from the inputs (attention's padding mask)
BOOL_MASK_KINDS = frozenset({"sdpa"})
#: integer results of torch calls on token ids (positions, masks built from ids): kept inside torch calls
COMPUTED_INDEX_DTYPES = frozenset({torch.int64, torch.int32, torch.bool})

#: calls that copy: an in-place write to their result leaves their input alone
CLONES = frozenset({torch.clone, torch.ops.aten.clone.default})
#: views that keep the elements in their order: an output that is one of another shares its memory as a view
RESHAPES = frozenset({"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
                      "contiguous", "detach", "alias"})
#: calls (by their last name) whose result is a view of their first input's memory
VIEWS = frozenset({"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
                   "transpose", "permute", "t", "T", "mT", "narrow", "select", "getitem", "movedim", "swapaxes",
                   "swapdims", "split", "chunk", "unbind", "expand", "expand_as", "diagonal", "as_strided",
                   "detach", "contiguous", "alias", "view_as_real", "view_as_complex"})

#: a torch call's lowering: ``(importer, node, args, kwargs, concrete) -> value`` (None: keep the call as a step)
Lowering = Callable[["Importer", fx.Node, Any, Any, Any], Any]
#: the lowering of a call of an ``nn.Module`` kept as a leaf by the tracer
ModuleLowering = Callable[["Importer", fx.Node, tuple[Any, ...], dict[str, Any]], Any]


# ---------------------------------------------------------------- values during import


@dataclass(frozen=True)
class Traced:
    """A tensor value during import: an IR tensor (``id``) or a not yet materialised source."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    runtime: bool  # depends on a call input
    id: str | None = None  # IR node id once materialised (computed values always have one)
    source: tuple[str, Any] | None = None  # ("arg", i) | ("state", name) for graph inputs
    name: str = ""
    #: an Opaque result not emitted yet: its single consumer, if torch-backed too, folds it in
    program: Program | None = field(default=None, compare=False)
    #: how the IR tensor ``id`` holds it: "" in torch's order (flattened), CHANNELS_LAST for an image batch
    #: (N, C, *pixels) stored as (N*pixels, C) rows (what convolutions compute)
    layout: str = ""


@dataclass(frozen=True)
class Emitted(Traced):
    """A value an op of the graph computes: it has its IR id."""

    id: str = ""


@dataclass(frozen=True, eq=False)
class Program:
    """Torch calls (JSON steps) over materialised IR inputs, the last one giving the value."""

    node: fx.Node
    steps: tuple[dict[str, Any], ...]
    inputs: tuple[str, ...]
    in_shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class MultiResult:
    """A call returning several tensors: each ``getitem`` becomes its own Opaque node."""

    node: fx.Node
    impl: str
    value: Any


_aten = torch.ops.aten
SHAPE_QUERIES = {("method", "size"), ("method", "dim"), ("method", "numel"), getattr, operator.getitem, len,
                  _aten.sym_size.int}


#: torch.export's checks of a tensor's dtype, device and layout (one per ``.to(dtype)``): no value
METADATA_ASSERTIONS = frozenset({_aten._assert_tensor_metadata.default})


def op_for_torch_call(target: Any, args: Any, kwargs: Any) -> str | None:
    """The op-table op whose ``torch_names`` name this call of one tensor and nothing else."""
    if len(args) != 1 or kwargs or not isinstance(args[0], Traced):
        return None
    name = torch_fn_name(target)
    for op in OPS.values():
        if name in op.torch_names and op.arity == 1 and not op.attrs and op.kind == OpKind.ELEMENTWISE:
            return op.name
    return None


def reduces_rows(x: Any, concrete: Any, dim: Any = -1) -> bool:
    """Is this a call the row ops can take: a float tensor ``x`` reduced over its last dimension ``dim``
    to a result of its own dtype?"""
    return (isinstance(x, Traced) and isinstance(concrete, torch.Tensor) and x.dtype == concrete.dtype
            and x.dtype in TORCH_DTYPES and isinstance(dim, int) and not isinstance(dim, bool)
            and dim in (-1, len(x.shape) - 1))


def out_of_place(target: Any) -> Any:
    """An in-place ATen op's out-of-place overload (``aten.relu_.default`` -> ``aten.relu.default``), else the
    target itself."""
    if isinstance(target, torch._ops.OpOverload) and target._opname.endswith("_"):
        packet = getattr(getattr(torch.ops, target.namespace), target._opname[:-1], None)
        return getattr(packet, target._overloadname, target) if packet is not None else target
    return target


def is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class Importer:
    name: str
    tracer: str
    gm: fx.GraphModule
    values: dict[fx.Node, Any]
    sources: list[tuple[str, Any]]  # per placeholder
    lowerings: Mapping[str, Lowering]  # IMPORTER_TABLE's kinds -> their lowering
    module_lowering: ModuleLowering
    module: nn.Module | None = None
    b: GraphBuilder = field(init=False)
    env: dict[fx.Node, Any] = field(default_factory=dict)
    bindings: dict[tuple[Any, ...], Binding] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    opaque_names: list[str] = field(default_factory=list)
    opaque_kernels: int = 0
    emitted: dict[int, str] = field(default_factory=dict)  # id(Program) -> IR id
    ids: set[str] = field(default_factory=set)
    #: the parameters and buffers values computed at import read (the plan holds those values)
    folded_from: set[str] = field(default_factory=set)
    #: (IR id, layout) -> the same tensor in that layout (converted once)
    relayouts: dict[tuple[str, str], str] = field(default_factory=dict)
    #: calls a lowering took into its own ops (a BatchNorm folded into its convolution) -> their value
    absorbed: dict[fx.Node, Any] = field(default_factory=dict)
    #: what a lowering derived once from a value and shares, by its key (a computed attention mask's additive form)
    derived: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.b = GraphBuilder(self.name)

    # -- ids and materialisation
    def fresh(self, base: str) -> str:
        clean = "".join(c if c.isalnum() or c in "_." else "_" for c in base)[:110] or "t"
        if not (clean[0].isalpha() or clean[0] == "_"):
            clean = "t_" + clean
        out, i = clean, 1
        while out in self.ids:
            i += 1
            out = f"{clean}_{i}"
        self.ids.add(out)
        return out

    def use(self, v: Any, hint: str, transpose: bool = False, ir_shape: tuple[int, ...] | None = None) -> str:
        """The IR id holding ``v`` (a tensor value) in torch's order, creating a graph input on first use (a
        constant with ``ir_shape``, its elements in their order, where given)."""
        if isinstance(v, Traced) and v.layout == CHANNELS_LAST:
            return self.relayout(v, "")
        if isinstance(v, Traced) and v.program is not None:
            return self.materialise(v)
        if isinstance(v, Traced) and v.id is not None and not transpose:
            return v.id
        if isinstance(v, Traced):
            assert v.source is not None
            key: tuple[Any, ...] = (*v.source, transpose)
            name_base = v.name
        else:
            key = ("const", hint, transpose)
            name_base = hint
        if key in self.bindings:
            return self.bindings[key].name
        tensor = v if isinstance(v, torch.Tensor) else None
        shape = tuple(v.shape)
        if isinstance(v, Traced) and v.source is not None and v.source[0] == "state":
            ir_dtype(v.dtype, f"buffer {name_base!r}")  # an integer buffer an op reads: refused, named
        dtype = "fp32" if isinstance(v, Traced) and v.dtype in INDEX_DTYPES else ir_dtype(v.dtype, f"tensor {name_base!r}")
        if ir_shape is None or tensor is None:
            ir_shape = (shape[1], shape[0]) if transpose else flat_shape(shape)
        nid = self.fresh(name_base + (".T" if transpose else ""))
        self.b.input(nid, ir_shape, dtype)
        if tensor is not None:
            self.constants[nid] = to_numpy(tensor, transpose).reshape(ir_shape)
            self.bindings[key] = Binding(nid, "const", hint, transpose, shape)
        else:
            assert isinstance(v, Traced) and v.source is not None
            self.bindings[key] = Binding(nid, v.source[0], v.source[1], transpose, shape)
        return nid

    def emit(self, node: fx.Node, op: str, inputs: Sequence[str], attrs: Mapping[str, Any] | None,
             shape: Sequence[int], dtype: torch.dtype, suffix: str = "", layout: str = "") -> Emitted:
        nid = self.fresh(node.name + suffix)
        try:
            self.b.op(nid, op, inputs, attrs)
        except GraphError as exc:
            raise TorchImportError(f"{self.where(node)}: {exc}") from None
        return Emitted(tuple(shape), dtype, True, nid, layout=layout)

    # -- image batches stored channels last
    def channels_last(self, v: Traced, hint: str) -> str:
        """The IR id of image batch ``v`` (N, C, *pixels) as (N*pixels, C) rows (converted once)."""
        if v.layout == CHANNELS_LAST:
            assert v.id is not None
            return v.id
        return self.relayout(Traced(v.shape, v.dtype, v.runtime, self.use(v, hint)), CHANNELS_LAST)

    def relayout(self, v: Traced, layout: str) -> str:
        """The IR id of ``v``'s tensor in ``layout`` (a ``ChannelsLast`` or ``ChannelsFirst`` copy, made once)."""
        assert v.id is not None
        key = (v.id, layout)
        if key not in self.relayouts:
            pixels = math.prod(v.shape[2:])
            if layout == CHANNELS_LAST:
                op, attrs = "ChannelsLast", {"channels": v.shape[1], "pixels": pixels}
            else:
                op, attrs = "ChannelsFirst", {"pixels": pixels, "width": v.shape[-1]}
            out = self.fresh(f"{v.id}.{'nhwc' if layout else 'nchw'}")
            self.b.op(out, op, [v.id], attrs)
            self.relayouts[key] = out
        return self.relayouts[key]

    def plain(self, tree: Any) -> Any:
        """``tree`` with each channels-last value in torch's order (for lowerings and calls that read that)."""
        return pytree.tree_map(lambda x: Traced(x.shape, x.dtype, x.runtime, self.use(x, "nchw"))
                               if isinstance(x, Traced) and x.layout == CHANNELS_LAST else x, tree)

    def where(self, node: fx.Node) -> str:
        st = node.meta.get("stack_trace")
        last = st.strip().splitlines()[-2].strip() if st and len(st.strip().splitlines()) >= 2 else None
        return f"node {node.name!r} ({node.format_node()})" + (f" from {last}" if last else "")

    # -- walking the graph
    def run(self) -> tuple[list[str], list[OutputSpec], Any]:
        ph = 0
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.source_value(node, self.sources[ph])
                ph += 1
            elif node.op == "get_attr":
                v = self.values[node]
                self.env[node] = (
                    Traced(tuple(v.shape), v.dtype, False, source=("state", node.target), name=str(node.target))
                    if isinstance(v, torch.Tensor) else v
                )
            elif node.op in ("call_function", "call_method", "call_module"):
                self.env[node] = self.call(node)
            elif node.op == "output":
                return self.outputs(node)
        raise TorchImportError("traced graph has no output node")

    def source_value(self, node: fx.Node, source: tuple[str, Any]) -> Any:
        v = self.values[node]
        if source[0] == "const":  # a size torch.compile passes as its own input: the plan is made for its value
            return v
        if not isinstance(v, torch.Tensor):
            raise TorchImportError(f"input {node.name!r} is a {type(v).__name__}; only tensor inputs are supported")
        # an integer buffer (BatchNorm's num_batches_tracked) is refused where an op reads it, not here: most
        # are never read in eval mode
        if not (source[0] in ("arg", "state") and v.dtype in INDEX_DTYPES):
            ir_dtype(v.dtype, f"input {node.name!r}")
        name = str(source[1]) if source[0] == "state" else node.name
        return Traced(tuple(v.shape), v.dtype, source[0] == "arg", source=source, name=name)

    def outputs(self, node: fx.Node) -> tuple[list[str], list[OutputSpec], Any]:
        leaves, tree = pytree.tree_flatten(node.args[0])
        outs: list[str] = []
        specs: list[OutputSpec] = []
        for i, leaf in enumerate(leaves):
            v = self.env.get(leaf) if isinstance(leaf, fx.Node) else leaf
            if not isinstance(v, (Traced, torch.Tensor)):
                raise TorchImportError(f"output {i} is a {type(v).__name__}; only tensor outputs are supported")
            oid = self.use(v, f"out{i}")
            if oid not in outs:
                outs.append(oid)
            arg, view_of = self.output_alias(leaf, leaves[:i])
            specs.append(OutputSpec(outs.index(oid), tuple(v.shape), v.dtype, arg, view_of))
        return outs, specs, tree

    def output_alias(self, leaf: Any, earlier: Sequence[Any]) -> tuple[int | None, int | None]:
        """(the call input, or the earlier output, whose memory output ``leaf`` is in eager torch): outputs that
        share memory there share it in the plan's results too. Only through reshapes (the elements in their
        order): an output that is a transposed or sliced view of another, or of an input, is refused."""
        node = leaf if isinstance(leaf, fx.Node) else None
        strided: fx.Node | None = None
        while node is not None:
            found: tuple[int | None, int | None] | None = None
            if node is not leaf and node in earlier:
                found = (None, earlier.index(node))
            elif node.op == "placeholder":
                held = self.env.get(node)
                ok = isinstance(held, Traced) and held.source is not None and held.source[0] == "arg"
                found = (int(held.source[1]), None) if ok else (None, None)  # type: ignore[union-attr]
            if found is not None:
                if strided is not None and found != (None, None):
                    raise TorchImportError(
                        f"{self.where(strided)}: an output is a strided view ({strided.target}) of another output or "
                        "of an input in eager torch, sharing its memory; a plan's outputs cannot: return a copy "
                        "(.contiguous()) or one of the two")
                return found
            first = node.args[0] if node.args else None
            if not (isinstance(first, fx.Node) and self.aliases_first_input(node, first)):
                return None, None
            if not self.reshapes(node):
                strided = strided or node
            node = first
        return None, None

    def reshapes(self, node: fx.Node) -> bool:
        """Does ``node`` keep its input's elements in their order (a reshape, not a transpose or a slice)?"""
        name = str(node.target) if node.op == "call_method" else torch_fn_name(node.target) or ""
        target = ("method", node.target) if node.op == "call_method" else node.target
        return IMPORTER_TABLE.get(target) in ("view", "same", "to", "dropout") or name.rsplit(".", 1)[-1] in RESHAPES

    def arg(self, a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: self.env[n])

    def call(self, node: fx.Node) -> Any:
        """Map one call; an in-place op is mapped out of place and rebinds the tensor it mutated. An in-place write
        into the memory of a call input, a parameter or a buffer is refused: a plan writes only its outputs, so
        eager torch's write would be lost."""
        mutated = self.mutated_input(node)
        for target in written_inputs(self.gm, node):
            written = self.written_source(target)
            if written is not None:
                value = self.env.get(written)
                state = written.op == "get_attr" or (isinstance(value, Traced) and value.source is not None
                                                     and value.source[0] == "state")
                kind = "parameter or buffer" if state else "call input"
                hint = (" (a BatchNorm in training mode updates its running statistics: call module.eval() to plan "
                        "inference)" if node.target in BATCH_NORMS or "running_" in written.name
                        or "num_batches" in written.name else "")
                raise TorchImportError(
                    f"{self.where(node)} writes the module's {kind} {written.name!r} in place; a plan writes only "
                    f"its outputs, so that write would be lost: return the new value instead, or run the module "
                    f"eagerly{hint}")
        before = self.env.get(mutated) if mutated is not None else None
        out = self._call(node)
        if mutated is not None and isinstance(out, (Traced, torch.Tensor)):
            self.env[mutated] = out
            if isinstance(out, Traced) and isinstance(before, Traced):
                self.write_through_views(node, mutated, before, out)
        return out

    def read_after(self, value: fx.Node, node: fx.Node, view: fx.Node) -> bool:
        """Does a node after ``node`` (the graph's output included) read ``value`` other than through ``view``?"""
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return any(u is not view and order[u] > order[node] for u in value.users)

    def write_through_views(self, node: fx.Node, view: fx.Node, before: Traced, after: Traced) -> None:
        """An in-place write into a view of a value the module computed changes the value it views too: each
        one it views as the same IR tensor (a reshape, channels moved last) is rebound to the written tensor;
        a view of part of it, or of its elements in another order, is refused (a plan's values are written once)."""
        while True:
            first = view.args[0] if view.args else None
            if not isinstance(first, fx.Node) or not self.aliases_first_input(view, first):
                return
            base = self.env.get(first)
            if not isinstance(base, Traced) or base.source is not None:
                return  # a call input or parameter: refused before the call (``written_inputs``)
            if base.id is None or base.id != before.id or before.program is not None or after.id is None:
                if self.read_after(first, node, view):
                    raise TorchImportError(
                        f"{self.where(node)} writes in place into a view of {first.name!r} that the plan holds as a "
                        "copy (part of it, its elements in another order or another shape), and "
                        f"{first.name!r} is read after the write; write the result to a new tensor instead")
                return
            self.env[first] = replace(base, id=after.id, dtype=after.dtype, runtime=after.runtime)
            view, before = first, base

    def written_source(self, node: fx.Node) -> fx.Node | None:
        """The placeholder or attribute whose memory ``node``'s tensor is (through views, ``contiguous``, ``detach``,
        in-place results: not through a ``clone``), or None for a value the module computed."""
        while node.op not in ("placeholder", "get_attr"):
            first = node.args[0] if node.args else None
            if not isinstance(first, fx.Node) or not self.aliases_first_input(node, first):
                return None
            node = first
        return node

    def aliases_first_input(self, node: fx.Node, first: fx.Node) -> bool:
        """Is ``node``'s result (a view of) the memory of its first input, as eager torch computes it?"""
        if node.op not in ("call_method", "call_function"):
            return False
        name = str(node.target) if node.op == "call_method" else torch_fn_name(node.target) or ""
        if node.target in CLONES or name.rsplit(".", 1)[-1] in ("clone", "copy"):
            return False
        if self.mutated_input(node) is not None:
            return True  # an in-place op returns the tensor it wrote
        target = ("method", node.target) if node.op == "call_method" else node.target
        kind = IMPORTER_TABLE.get(target)
        if kind in ("view", "expand", "same", "dropout", "slice"):
            return True
        if kind == "to":  # .to(dtype), .float(): the tensor itself when it is of that dtype already
            a, b = self.values.get(node), self.values.get(first)
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return name.rsplit(".", 1)[-1] in VIEWS


    def mutated_input(self, node: fx.Node) -> fx.Node | None:
        return mutated_input_of(self.gm, node)

    def _call(self, node: fx.Node) -> Any:
        if node in self.absorbed:
            return self.absorbed.pop(node)
        args, kwargs = self.arg(node.args), self.arg(node.kwargs)
        if node.op == "call_module":
            return self.module_lowering(self, node, args, kwargs)
        fn_target: Any = node.target
        if self.mutated_input(node) is not None:
            if node.op == "call_method":
                fn_target = str(node.target)[:-1]
            fn_target = INPLACE_OPERATORS.get(fn_target, out_of_place(fn_target))
            if "inplace" in kwargs:
                kwargs = {**kwargs, "inplace": False}
        target = ("method", fn_target) if node.op == "call_method" else fn_target
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, (Traced, MultiResult))]
        concrete = self.values[node]
        if not any(isinstance(x, MultiResult) or x.runtime for x in leaves):
            self.folded_from.update(str(x.source[1]) for x in leaves
                                    if isinstance(x, Traced) and x.source is not None and x.source[0] == "state")
            return self.fold(node, concrete)
        if target in METADATA_ASSERTIONS:
            return None  # it held on the example inputs, and a call with another dtype or shape is refused
        if not isinstance(concrete, torch.Tensor) and not isinstance(concrete, (tuple, list)):
            if IMPORTER_TABLE.get(target) is None and target not in SHAPE_QUERIES:
                raise TorchImportError(
                    f"{self.where(node)} turns a tensor into the Python value {concrete!r}: data-dependent "
                    "values cannot be planned; use torch.export with torch.cond, or keep the value a tensor"
                )
            return concrete  # a shape query: shapes are fixed at planning time
        if target in SHAPE_QUERIES and not isinstance(concrete, torch.Tensor) and target is not operator.getitem:
            return concrete
        if target is operator.getitem and isinstance(args[0], MultiResult):
            return self.opaque(node, args[0].impl, args[0].node, item=int(args[1]))
        if target is operator.getitem and not isinstance(args[0], Traced):
            return concrete  # indexing a shape tuple
        kind = IMPORTER_TABLE.get(target)
        # a unary op the op table names (exp, tanh, sigmoid, ...) of a float value: elementwise, so it keeps the
        # value's layout (a channels-last image batch stays channels last)
        op = op_for_torch_call(fn_target, args, kwargs) if kind is None else None
        if op is not None and isinstance(concrete, torch.Tensor) and args[0].dtype in TORCH_DTYPES:
            return self.unary(node, op, args[0], concrete)
        if kind not in LAYOUT_KINDS:
            args, kwargs = self.plain(args), self.plain(kwargs)
            leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, (Traced, MultiResult))]
        if kind not in INDEX_KINDS and any(isinstance(x, Traced) and x.dtype not in TORCH_DTYPES
                                           and not (kind in BOOL_MASK_KINDS and x.dtype == torch.bool) for x in leaves):
            return self.generic(node, fn_target, args, kwargs)  # integer indices: only torch computes with them
        handler = self.lowerings.get(kind) if kind else None
        if handler is not None:
            out = handler(self, node, args, kwargs, concrete)
            if out is not None:
                return out
        return self.generic(node, fn_target, args, kwargs)

    def fold(self, node: fx.Node, concrete: Any) -> Any:
        """A value computed from constants and parameters only: captured at import."""
        if isinstance(concrete, torch.Tensor):
            return concrete.detach().clone()
        return concrete

    def unary(self, node: fx.Node, op: str, x: Any, concrete: torch.Tensor,
              attrs: Mapping[str, Any] | None = None) -> Traced | None:
        if not isinstance(x, Traced):
            return None
        if x.layout == CHANNELS_LAST:  # an elementwise op keeps the layout
            assert x.id is not None
            return self.emit(node, op, [x.id], attrs, concrete.shape, concrete.dtype, layout=CHANNELS_LAST)
        return self.emit(node, op, [self.use(x, node.name)], attrs, concrete.shape, concrete.dtype)


    # -- rows: reductions over the last dimension and what is made of them.  In a 16-bit graph an unfused
    # plan stores the row statistics in 16 bits, where torch keeps them in fp32; a fused row kernel keeps
    # them in fp32 registers, as torch does.  Both are candidates; the output check judges each.


    # -- everything else
    def generic(self, node: fx.Node, target: Any, args: Any, kwargs: Any) -> Any:
        name = trust_traced(target)  # the module is trusted code: an unlisted op is kept, for this process only
        if name is None:
            raise TorchImportError(
                f"{self.where(node)}: {target!r} is not a torch function the planner can name; "
                "it cannot be executed as an Opaque kernel"
            )
        concrete = self.values[node]
        if isinstance(concrete, (tuple, list)):
            return MultiResult(node, name, concrete)
        return self.opaque_call(node, name, args, kwargs, concrete)

    def opaque(self, getitem: fx.Node, impl: str, call_node: fx.Node, item: int) -> Traced:
        args, kwargs = self.arg(call_node.args), self.arg(call_node.kwargs)
        return self.opaque_call(getitem, impl, args, kwargs, self.values[getitem], item=item)

    def opaque_call(self, node: fx.Node, impl: str, args: Any, kwargs: Any, concrete: Any, item: int = -1) -> Traced:
        """A torch call as an Opaque node; single-use torch-backed inputs are folded into its steps."""
        if not isinstance(concrete, torch.Tensor):
            raise TorchImportError(f"{self.where(node)} returns a {type(concrete).__name__}, not a tensor")
        if concrete.dtype not in COMPUTED_INDEX_DTYPES:
            ir_dtype(concrete.dtype, f"the result of {self.where(node)}")
        try:
            resolve_torch_fn(impl)
        except OpError as exc:
            raise TorchImportError(f"{self.where(node)}: {exc}") from None
        inputs: list[str] = []
        in_shapes: list[tuple[int, ...]] = []
        steps: list[dict[str, Any]] = []
        folded: dict[int, int] = {}  # id(Program) -> its last step here

        def add_input(nid: str, shape: tuple[int, ...]) -> int:
            if nid not in inputs:
                inputs.append(nid)
                in_shapes.append(shape)
            return inputs.index(nid)

        def fold(p: Program) -> int:
            if id(p) not in folded:
                base = len(steps)
                remap = {k: add_input(nid, shp) for k, (nid, shp) in enumerate(zip(p.inputs, p.in_shapes, strict=True))}
                steps.extend(renumber(st, remap, base) for st in p.steps)
                folded[id(p)] = len(steps) - 1
            return folded[id(p)]

        shapes: list[list[int]] = []

        def ref(v: Any) -> dict[str, int] | None:
            is_float = isinstance(v, torch.Tensor) and v.dtype in TORCH_DTYPES
            if not isinstance(v, Traced) and not is_float:
                return None
            shapes.append(list(v.shape))
            if isinstance(v, Traced) and v.program is not None and (len(v.program.node.users) == 1
                                                                  or v.dtype not in TORCH_DTYPES):
                return {"$step": fold(v.program)}  # indices are computed again by each torch call that reads them
            ref_in = {"$in": add_input(self.use(v, f"{node.name}_const{len(inputs)}"), tuple(v.shape))}
            if isinstance(v, Traced) and v.dtype in INDEX_DTYPES:  # bound as fp32: the indices again, as torch takes them
                steps.append({"impl": INDEX_STEP, "args": [ref_in], "kwargs": {"$dict": {}}, "item": -1,
                              "shapes": [list(v.shape)], "out": list(v.shape)})
                return {"$step": len(steps) - 1}
            return ref_in

        try:
            step = {"impl": impl, "args": encode_arg(list(args), ref), "kwargs": encode_arg(dict(kwargs), ref)}
        except TypeError as exc:
            raise TorchImportError(f"{self.where(node)}: {exc}") from None
        step.update({"item": item, "shapes": shapes, "out": list(concrete.shape)})
        steps.append(step)
        value = Traced(tuple(concrete.shape), concrete.dtype, True,
                   program=Program(node, tuple(steps), tuple(inputs), tuple(in_shapes)))
        users = list(node.users)
        if (len(users) == 1 and users[0].op != "output") or concrete.dtype not in TORCH_DTYPES:
            return value  # emitted when its consumer is not torch-backed; indices only inside torch calls
        return Traced(value.shape, value.dtype, True, self.materialise(value))

    def materialise(self, v: Traced) -> str:
        """Emit a pending torch-backed value as one Opaque node (once)."""
        p = v.program
        assert p is not None
        if v.dtype not in TORCH_DTYPES:
            raise TorchImportError(
                f"{self.where(p.node)} computes {str(v.dtype).removeprefix('torch.')} values from the inputs that are "
                "used as a tensor of the plan (an output, or an operand of a planned op); the planner computes "
                "float tensors, and integer ones only inside the torch calls that read them")
        if id(p) not in self.emitted:
            layout = self.layout_op(p, v)
            if layout is not None:
                self.emitted[id(p)] = layout
        if id(p) not in self.emitted:
            call = {"steps": list(p.steps), "in": [list(s) for s in p.in_shapes], "out": list(v.shape)}
            # named after its heaviest call (attention rather than the transposes around it)
            impl = str(max(reversed(p.steps), key=step_flops)["impl"])
            out = self.emit(p.node, "Opaque", list(p.inputs), {"impl": impl, "call": json.dumps(call, separators=(",", ":"))},
                            v.shape, v.dtype)
            assert out.id is not None
            self.emitted[id(p)] = out.id
            self.opaque_kernels += 1
            self.opaque_names.extend(str(st["impl"]) for st in p.steps)
        return self.emitted[id(p)]


    def then(self, v: Traced, impl: str, args: Sequence[Any], shape: tuple[int, ...], dtype: torch.dtype) -> Traced:
        """Pending value ``v`` with one more torch call ``impl(v, *args)`` (``args`` plain Python values)
        appended: still pending, materialised with the rest as one Opaque node."""
        p = v.program
        assert p is not None
        step = {"impl": impl, "args": [{"$step": len(p.steps) - 1}, *encode_arg(list(args), lambda _: None)],
                "kwargs": {"$dict": {}}, "item": -1, "shapes": [list(v.shape)], "out": list(shape)}
        return Traced(shape, dtype, True, program=Program(p.node, (*p.steps, step), p.inputs, p.in_shapes))

    def layout_op(self, p: Program, v: Traced) -> str | None:
        """The op-table layout op a pending torch program is, emitted: heads merged back (``Merge``), heads taken
        out of token rows (``Heads``), rows of another length (:meth:`regroup_op`), RoPE's ``RotateHalf``, columns of
        a packed projection (``Columns``); None when it is none of them."""
        in_ir = self.b.shape_of(p.inputs[0]) if len(p.inputs) == 1 else None
        heads = head_merge(p.steps, p.in_shapes, v.shape)
        if heads is not None and in_ir == head_major_shape(p.in_shapes[0]):
            return self.emit(p.node, "Merge", [p.inputs[0]], {"heads": heads}, v.shape, v.dtype).id
        split = head_split(p.steps, p.in_shapes)
        if split is not None and in_ir == flat_shape(p.in_shapes[0]):
            layout = split[1]
            attrs = {"heads": layout.heads, "seq": layout.seq, "offset": layout.offset, "width": layout.width}
            return self.emit(p.node, "Heads", [p.inputs[0]], attrs, v.shape, v.dtype).id
        if in_ir is not None and in_ir == flat_shape(p.in_shapes[0]):
            regroup = self.regroup_op(p, v)
            if regroup is not None:
                return regroup
        if rotate_half(p.steps, p.in_shapes, v.shape) and in_ir is not None and in_ir[-1] == v.shape[-1]:
            return self.emit(p.node, "RotateHalf", [p.inputs[0]], None, v.shape, v.dtype).id
        taken = column_take(p.steps, p.in_shapes, v.shape)
        if taken is not None and in_ir is not None and in_ir[-1] == p.in_shapes[0][-1]:
            return self.emit(p.node, "Columns", [p.inputs[0]], {"offset": taken[0], "width": taken[1]}, v.shape,
                             v.dtype).id
        return None

    def regroup_op(self, p: Program, v: Traced) -> str | None:
        """A view of a value stored as rows as rows of another length (``Regroup``), or heads taken out of such a
        view (``Regroup`` back to token rows, then ``Heads``); None when ``p`` is neither."""
        if regrouped(p.steps, p.in_shapes, v.shape):
            return self.emit(p.node, "Regroup", [p.inputs[0]], {"width": v.shape[-1]}, v.shape, v.dtype).id
        if not rows_to_heads(p.steps, p.in_shapes):
            return None
        b, s, h, d = p.in_shapes[0]
        rows = self.emit(p.node, "Regroup", [p.inputs[0]], {"width": h * d}, (b, s, h * d), v.dtype, "_rows")
        attrs = {"heads": h, "seq": s, "offset": 0, "width": h * d}
        return self.emit(p.node, "Heads", [rows.id], attrs, v.shape, v.dtype).id


def renumber(step: dict[str, Any], inputs: Mapping[int, int], base: int) -> dict[str, Any]:
    """A folded step with its input and step references moved to the consumer's numbering."""

    def walk(d: Any) -> Any:
        if isinstance(d, list):
            return [walk(x) for x in d]
        if isinstance(d, dict):
            if set(d) == {"$in"}:
                return {"$in": inputs[d["$in"]]}
            if set(d) == {"$step"}:
                return {"$step": base + d["$step"]}
            return {k: walk(x) for k, x in d.items()}
        return d

    return {**step, "args": walk(step["args"]), "kwargs": walk(step["kwargs"])}


def head_major_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The IR shape of a (batch, heads, seq, d) value the op table computes: (batch * heads, seq, d)."""
    b, h, s, d = shape
    return (b * h, s, d)


def is_tensor(v: Any) -> bool:
    return isinstance(v, (Traced, torch.Tensor))


def is_leaf_tensor(v: Any) -> bool:
    """A tensor the importer can bind as a graph input (possibly transposed)."""
    return isinstance(v, torch.Tensor) or (isinstance(v, Traced) and v.source is not None)


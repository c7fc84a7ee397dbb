"""Import a torch ``nn.Module`` (or a torch.compile graph) into the planner's IR.

Tracing: ``torch.fx`` symbolic tracing first, ``torch.export`` where fx fails
(shape-dependent Python control flow, modules fx cannot trace).  The traced
graph is run once on the example inputs so every node has a concrete value;
shapes, dtypes and constants come from those values.

Mapping (everything else becomes an ``Opaque`` node executed by torch, see
:mod:`planner.torch.ops`):

* ``nn.Linear`` / ``F.linear``  -> ``MatMul`` with the weight bound transposed as a
  ``(K, N)`` input, then ``BiasAdd``;
* GELU by its ``approximate`` argument -> ``GeluTanh`` / ``GeluErf``; relu -> ``Relu``;
  silu -> ``Silu``;
* tensor + tensor -> ``Add`` (``BiasAdd`` for a 1-D row vector), tensor - tensor -> ``Sub``,
  tensor * tensor -> ``Mul``, tensor / tensor -> ``Div``, ``torch.maximum`` / ``torch.minimum`` ->
  ``Maximum`` / ``Minimum`` (operands of one shape); ``-x`` -> ``Neg``;
* exp, tanh, sigmoid, sqrt, rsqrt, square of one tensor -> the op-table op whose ``torch_names`` name
  the call; ``x ** p`` for p = 2, 3, 0.5, -0.5 -> ``Square`` (and ``Mul``), ``Sqrt``, ``Rsqrt``;
* a tensor with a Python scalar (``x*a``, ``x+b``, ``x-b``, ``b-x``, ``x/a``) -> ``Affine``;
* mean / sum / amax over the last dimension with ``keepdim=True`` -> ``RowMean`` / ``RowSum`` /
  ``RowMax``; a tensor with one value per row (``[..., 1]``) -> ``AddRow`` .. ``DivRow``; a tensor times a
  row vector -> ``BiasMul``; LayerNorm, RMSNorm and softmax over the last dimension -> those primitives;
* views that keep the flattened shape, eval-mode dropout, contiguous/clone -> no node.

IR tensors are stored flattened: leading dims fold into one row dim, so a
``(B, S, D)`` activation is a ``(B*S, D)`` IR tensor and Linear is a plain 2-D
GEMM (:func:`planner.core.opaque.flat_shape`).  Parameters and buffers become
graph inputs bound from the module at call time; constant tensors computed
from them at import are captured.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import math
import operator
import os
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from planner.core.dtypes import DTYPES, numpy_dtype
from planner.core.graph import Graph, GraphBuilder, GraphError
from planner.core.inputs import INDEX_STEP
from planner.core.kinds import OpKind
from planner.core.opaque import flat_shape, step_flops
from planner.core.ops import OPS, OpError
from planner.torch.errors import TorchImportError
from planner.torch.heads import head_merge, head_split, rotate_half, takes_columns
from planner.torch.ops import IMPORTER_TABLE as _CANON
from planner.torch.ops import encode_arg, resolve_torch_fn, torch_fn_name, trust_traced
from planner.torch.projections import pack_projections

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[torch.dtype, str] = {getattr(torch, d.torch_name): d.name for d in DTYPES.values()}
#: the 16-bit dtypes, handed to backends as numpy arrays of their own dtype (float16, ml_dtypes' bfloat16)
_BITS = frozenset({torch.float16, torch.bfloat16})
#: integer call inputs (token ids) the importer accepts: bound as fp32 (exact below 2**24), converted back with
#: ``.long()`` right before the Opaque call that takes them, and never read by an op of the op table
INDEX_DTYPES = frozenset({torch.int64, torch.int32})
INDEX_LIMIT = 2**24
_TORCH_DIR = os.path.dirname(torch.__file__)
_PLANNER_DIR = os.path.dirname(os.path.abspath(__file__))


def ir_dtype(dtype: torch.dtype, what: str) -> str:
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise TorchImportError(
            f"{what} has dtype {str(dtype).removeprefix('torch.')}; the planner supports float32, float16 and bfloat16 only"
        ) from None


# ---------------------------------------------------------------- the imported module


@dataclass(frozen=True)
class Binding:
    """Where the value of one graph input comes from at call time."""

    name: str  # IR input id
    #: "arg" (flattened call inputs) | "state" (module parameter/buffer) | "const" | "packed" (parameters side by
    #: side, ``key`` their names: attention's q, k and v weights as one, torch.projections)
    source: str
    key: int | str | tuple[str, ...]
    transpose: bool = False  # a Linear weight bound as (K, N)
    shape: tuple[int, ...] = ()  # torch shape of the source tensor


@dataclass(frozen=True)
class OutputSpec:
    index: int  # position in graph.outputs
    shape: tuple[int, ...]  # torch shape
    dtype: torch.dtype


@dataclass(frozen=True)
class ImportedModule:
    """A module's IR graph plus how to feed it and how to rebuild its outputs."""

    graph: Graph
    bindings: tuple[Binding, ...]
    constants: Mapping[str, np.ndarray]
    arg_specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]  # flattened call inputs
    outputs: tuple[OutputSpec, ...]
    out_tree: Any  # pytree spec of the module's return value
    opaque_ops: tuple[str, ...]
    tracer: str  # "fx" | "export" | "dynamo"

    def check_args(self, args: Sequence[Any]) -> list[torch.Tensor]:
        # plain tensors (the common call) need no pytree walk, which cost about 10 µs a call
        flat = list(args) if all(type(a) is torch.Tensor for a in args) else pytree.tree_flatten(tuple(args))[0]
        if len(flat) != len(self.arg_specs):
            raise TorchImportError(f"expected {len(self.arg_specs)} input tensor(s) as at planning time, got {len(flat)}")
        for i, (t, (shape, dtype)) in enumerate(zip(flat, self.arg_specs, strict=False)):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or not t.is_cpu or t.requires_grad:
                _check_arg(i, t, shape, dtype)
        return flat

    def wrap_outputs(self, arrays: Sequence[np.ndarray]) -> Any:
        leaves = []
        for o in self.outputs:
            arr = arrays[o.index]
            t = torch.from_numpy(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr))
            if t.dtype == torch.uint16 and o.dtype in _BITS:  # a 16-bit output handed out as its bits
                t = t.view(o.dtype)
            elif t.dtype != o.dtype:
                t = t.to(o.dtype)
            leaves.append(t if t.shape == o.shape else t.reshape(o.shape))
        if len(leaves) == 1 and self.out_tree.is_leaf():  # one tensor returned: no pytree rebuild
            return leaves[0]
        return pytree.tree_unflatten(leaves, self.out_tree)


def _check_arg(i: int, t: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise the error that call input ``i`` deserves, if any (a tensor that needs grad is fine under no_grad)."""
    if not isinstance(t, torch.Tensor):
        raise TorchImportError(f"input {i} is a {type(t).__name__}, expected a tensor")
    if t.device.type != "cpu":
        raise TorchImportError(f"input {i} is on {t.device}; a plan takes host tensors: pass it with .cpu()")
    if t.requires_grad and torch.is_grad_enabled():
        raise TorchImportError(
            f"input {i} requires grad, but a plan computes no gradients: call it under torch.no_grad() or "
            "torch.inference_mode(), or pass the input detached"
        )
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise TorchImportError(
            f"input {i} is {_describe(t)}, but the plan was made for "
            f"{list(shape)} {str(dtype).removeprefix('torch.')}; plan again for new shapes"
        )


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def graph_inputs_from_module(
    imported: ImportedModule, module: nn.Module | Mapping[str, torch.Tensor] | None, args: Sequence[Any]
) -> dict[str, np.ndarray]:
    """The graph's input arrays (flattened to IR shapes; float32, or the 16-bit dtype's own numpy dtype) for one
    call: call inputs, parameters,
    buffers (a planned module keeps a :class:`BoundInputs` instead, which converts parameters once)."""
    return BoundInputs(imported, module).feed(args)


class BoundInputs:
    """A planned module's graph inputs, its parameters and buffers converted once.

    Each call converts only the call inputs. A parameter or buffer that changed since it was
    converted, in place (torch's version counter moved) or replaced by another tensor, is
    converted again. Bound arrays are read-only: views of the tensor's own memory where it is
    stored as the kernels read it (eager torch and the plan then share one copy of the weights
    in memory and in cache), converted copies otherwise. An update that bypasses the version
    counter (``param.data`` written in place) is not seen in a copy: call :meth:`rebind` after one.
    """

    def __init__(self, imported: ImportedModule, module: nn.Module | Mapping[str, torch.Tensor] | None) -> None:
        self.imported = imported
        self.module = module
        self._bound: dict[str, tuple[torch.Tensor, int, np.ndarray]] = {}
        self._packed: dict[str, tuple[list[torch.Tensor], list[int], np.ndarray]] = {}
        self._owners: dict[str, tuple[Any, str]] = {}  # key -> (the submodule holding it, its attribute name)
        self.conversions = 0  # parameters and buffers converted so far (tests count them)

    def rebind(self) -> None:
        """Forget every bound parameter: the next call converts them all again."""
        self._bound.clear()
        self._packed.clear()

    def feed(self, args: Sequence[Any]) -> dict[str, np.ndarray]:
        flat = self.imported.check_args(args)
        out: dict[str, np.ndarray] = {}
        for b in self.imported.bindings:
            if b.source == "const":
                out[b.name] = self.imported.constants[b.name]
            elif b.source == "arg":
                out[b.name] = _to_numpy(flat[int(b.key)], b.transpose)  # type: ignore[arg-type]
            elif b.source == "packed":
                out[b.name] = self._packed_input(b)
            else:
                out[b.name] = self._state_input(b)
        return out

    def _state_tensor(self, key: str) -> torch.Tensor | None:
        """The parameter or buffer ``key``, read from its submodule on every call (a reassigned parameter is
        seen); the submodule itself is found once (``get_submodule`` walked the path for a few µs a binding)."""
        if not isinstance(self.module, nn.Module):  # a state dict (or nothing)
            return (self.module or {}).get(key)
        owner = self._owners.get(key)
        if owner is None:
            path, _, name = key.rpartition(".")
            try:
                owner = self._owners[key] = (self.module.get_submodule(path), name)
            except AttributeError:
                return None
        t = getattr(owner[0], owner[1], None)
        return t if isinstance(t, torch.Tensor) else None

    def _state_input(self, b: Binding) -> np.ndarray:
        t = self._state_tensor(str(b.key))
        if t is None:
            raise TorchImportError(f"module has no parameter or buffer {b.key!r} (graph input {b.name!r})")
        bound = self._bound.get(b.name)
        if bound is not None and bound[0] is t and bound[1] == t._version:
            return bound[2]
        arr = _to_numpy(t, b.transpose)  # a view where the tensor's memory has the stored layout
        arr.setflags(write=False)
        self._bound[b.name] = (t, t._version, arr)
        self.conversions += 1
        return arr


    def _packed_input(self, b: Binding) -> np.ndarray:
        """Parameters side by side (weights by columns, biases end to end), made again when one changed."""
        keys = [str(k) for k in b.key]  # type: ignore[union-attr]
        tensors = [self._state_tensor(k) for k in keys]
        if any(t is None for t in tensors):
            missing = keys[[t is None for t in tensors].index(True)]
            raise TorchImportError(f"module has no parameter or buffer {missing!r} (packed graph input {b.name!r})")
        ts: list[torch.Tensor] = tensors  # type: ignore[assignment]
        versions = [t._version for t in ts]
        held = self._packed.get(b.name)
        if held is not None and held[1] == versions and all(x is y for x, y in zip(held[0], ts, strict=True)):
            return held[2]
        with torch.no_grad():
            packed = torch.cat([t.detach() for t in ts], 0)  # (sum N_i, K): nn.Linear's layout, read transposed
        arr = _to_numpy(packed, b.transpose)
        arr.setflags(write=False)
        self._packed[b.name] = (ts, versions, arr)
        self.conversions += 1
        return arr


def _to_numpy(t: torch.Tensor, transpose: bool = False) -> np.ndarray:
    if t.dtype in INDEX_DTYPES and t.numel() and int(t.abs().max()) >= INDEX_LIMIT:
        raise TorchImportError(f"integer input {_describe(t)} holds values of {INDEX_LIMIT} or more: a plan carries "
                               "indices as fp32, exact only below that")
    if t.dtype == torch.float32 and t.is_cpu and t.is_contiguous():
        a = t.detach().numpy()  # the tensor's own memory: no conversion call on the way
        # a Linear weight (N, K) read as (K, N): its transpose, a view (the GEMM library takes either order)
        return a.T if transpose else a.reshape(flat_shape(a.shape))
    t = t.detach()
    if t.dtype in _BITS:  # 16-bit: an array of its own dtype over the tensor's bits (a view where contiguous)
        bits = t.cpu().contiguous().view(torch.int16).numpy().view(numpy_dtype(TORCH_DTYPES[t.dtype]))
        return bits.T if transpose else bits.reshape(flat_shape(bits.shape))
    if transpose:
        t = t.t()
    a = t.to(torch.float32).cpu().contiguous().numpy()
    return a.reshape(flat_shape(a.shape))


# ---------------------------------------------------------------- tracing


class _Tracer(fx.Tracer):
    """Keeps only the modules the importer maps as leaves; traces into all others. With the example inputs, a
    loop over a traced value of fixed length (``for t in x.split(d, -1)``, which fx cannot iterate) runs over
    its items, the length taken from the graph traced so far run on those inputs."""

    LEAVES = (nn.Linear, nn.GELU, nn.ReLU, nn.SiLU, nn.LayerNorm, nn.Dropout, nn.Identity)

    def __init__(self, example_args: tuple[Any, ...] | None = None) -> None:
        super().__init__()
        self.example_args = example_args

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return type(m) in self.LEAVES

    def iter(self, obj: fx.Proxy) -> Any:
        try:
            value = self._concrete(obj.node) if self.example_args is not None else None
        except Exception as exc:  # the model's own error on these inputs: torch.export reports it better
            log.debug("no concrete value to iterate over (%s)", _first_line(exc))
            value = None
        if not isinstance(value, (tuple, list)):
            return super().iter(obj)
        return iter([obj[i] for i in range(len(value))])  # type: ignore[index]  # Proxy.__getitem__ is dynamic

    def _concrete(self, target: fx.Node) -> Any:
        """The value of ``target`` on the example inputs (None when the graph so far cannot say: an in-place
        op, which must not touch the caller's tensors, or more placeholders than inputs)."""
        assert self.example_args is not None
        values: dict[fx.Node, Any] = {}
        inputs = iter(self.example_args)
        with torch.no_grad():
            for n in self.graph.nodes:
                if _mutated_input(self.root, n) is not None:
                    return None
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
                if n.op == "placeholder":
                    values[n] = next(inputs, None)
                elif n.op == "get_attr":
                    values[n] = _attr(self.root, str(n.target))
                elif n.op == "call_function":
                    values[n] = n.target(*args, **kwargs)
                elif n.op == "call_method":
                    values[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
                elif n.op == "call_module":
                    values[n] = self.root.get_submodule(str(n.target))(*args, **kwargs)
                if n is target:
                    return values[n]
        return None


def _attr(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _mutated_input(gm: nn.Module, node: fx.Node) -> fx.Node | None:
    """The node whose tensor an in-place call (``x.add_(y)``, ``x += y``, ``inplace=True``) overwrites."""
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_method":
        name = str(node.target)
        inplace = name.endswith("_") and not name.startswith("_")
    elif node.op == "call_module":
        inplace = bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    elif node.op == "call_function":
        inplace = node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True
    else:
        return None
    return first if inplace else None


class _Recorder(fx.Interpreter):
    """Runs a graph once and keeps every node's concrete value."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}
        # an in-place op later in the graph must not change a value recorded before it; without one,
        # no value is copied (a copy of every activation cost as much as running the model again)
        self.copy = any(_mutated_input(gm, n) is not None for n in gm.graph.nodes)

    def run_node(self, n: fx.Node) -> Any:
        v = super().run_node(n)
        self.values[n] = v.detach().clone() if self.copy and isinstance(v, torch.Tensor) and n.op.startswith("call_") else v
        return v


def _user_frame(exc: BaseException) -> str | None:
    """``file:line (`source`)`` of the innermost frame of user code in a traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    frames = [f for f in frames if not f.filename.startswith("<") and f.line]  # generated code has no source
    frames = [f for f in frames if os.path.dirname(os.path.abspath(f.filename)) != _PLANNER_DIR]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _trace(module: nn.Module | torch.export.ExportedProgram, args: tuple[Any, ...],
           strategy: str) -> tuple[fx.GraphModule, list[Any], str, Any, Any]:
    """Trace with fx, else torch.export; returns the graph module, its placeholder values, the tracer, the
    placeholders' sources and the pytree spec of the module's result (None: the graph's output node has it)."""
    fx_error: BaseException | None = None
    if strategy in ("auto", "fx"):
        try:
            tracer = _Tracer(args)
            graph = tracer.trace(module)
            gm = fx.GraphModule(tracer.root, graph)
            n_ph = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
            if n_ph != len(args):
                raise TorchImportError(f"forward takes {n_ph} input(s) after tracing, got {len(args)} example input(s)")
            return gm, list(args), "fx", None, None
        except TorchImportError:
            raise
        except Exception as exc:  # fx raises TraceError, TypeError, AttributeError ... on untraceable code
            fx_error = exc
            if strategy == "fx":
                raise _untraceable(exc, None) from exc
            log.info("torch.fx could not trace %s (%s); trying torch.export", type(module).__name__, _first_line(exc))
    try:
        ep = module if isinstance(module, torch.export.ExportedProgram) else torch.export.export(module, args)
    except Exception as exc:
        raise _untraceable(fx_error, exc) from exc
    return _from_export(ep, args)


def _from_export(ep: torch.export.ExportedProgram, args: tuple[Any, ...]) -> tuple[fx.GraphModule, list[Any], str, Any, Any]:

    state = {**ep.state_dict, **ep.constants}
    flat_args, _ = pytree.tree_flatten(args)
    values: list[Any] = []
    sources: list[tuple[str, Any]] = []
    user = 0
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            values.append(flat_args[user])
            sources.append(("arg", user))
            user += 1
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            values.append(state[spec.target])
            sources.append(("state", spec.target))
        else:
            raise TorchImportError(f"exported program input {spec.arg.name!r} has unsupported kind {spec.kind.name}")
    # the exported graph returns a flat tuple; the module's own result structure (one tensor, a dict) is this spec
    return ep.graph_module, values, "export", sources, ep.call_spec.out_spec


def _untraceable(fx_exc: BaseException | None, export_exc: BaseException | None) -> TorchImportError:
    where = _user_frame(fx_exc) if fx_exc is not None else None
    if where is None and export_exc is not None:
        where = _user_frame(export_exc)
    head = "the module cannot be traced" + (f" at {where}" if where else "")
    errors = [f"torch.fx: {_first_line(e)}" for e in (fx_exc,) if e is not None]
    errors += [f"torch.export: {_first_line(e)}" for e in (export_exc,) if e is not None]
    text = " ".join(errors)
    if "control flow" in text or "data-dependent" in text or "DataDependent" in text:
        hint = (
            "Data-dependent Python control flow (an `if`/`while` on tensor values) cannot be planned: "
            "rewrite it with torch.cond or torch.where so that torch.export.export(module, inputs) succeeds"
        )
    else:
        hint = "Run torch.export.export(module, inputs) to see the failing construct, then pass the ExportedProgram"
    return TorchImportError(f"{head}: {'; '.join(errors)}. {hint}.")


# ---------------------------------------------------------------- values during import


@dataclass(frozen=True)
class _T:
    """A tensor value during import: an IR tensor (``id``) or a not yet materialised source."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    runtime: bool  # depends on a call input
    id: str | None = None  # IR node id once materialised (computed values always have one)
    source: tuple[str, Any] | None = None  # ("arg", i) | ("state", name) for graph inputs
    name: str = ""
    #: an Opaque result not emitted yet: its single consumer, if torch-backed too, folds it in
    program: _Program | None = field(default=None, compare=False)


@dataclass(frozen=True, eq=False)
class _Program:
    """Torch calls (JSON steps) over materialised IR inputs, the last one giving the value."""

    node: fx.Node
    steps: tuple[dict[str, Any], ...]
    inputs: tuple[str, ...]
    in_shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _Multi:
    """A call returning several tensors: each ``getitem`` becomes its own Opaque node."""

    node: fx.Node
    impl: str
    value: Any


_INPLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                      operator.itruediv: operator.truediv}
_aten = torch.ops.aten
_SHAPE_QUERIES = {("method", "size"), ("method", "dim"), ("method", "numel"), getattr, operator.getitem, len,
                  _aten.sym_size.int}


#: torch.export's checks of a tensor's dtype, device and layout (one per ``.to(dtype)``): no value
_METADATA_ASSERTIONS = frozenset({_aten._assert_tensor_metadata.default})


def _op_for_torch_call(target: Any, args: Any, kwargs: Any) -> str | None:
    """The op-table op whose ``torch_names`` name this call of one tensor and nothing else."""
    if len(args) != 1 or kwargs or not isinstance(args[0], _T):
        return None
    name = torch_fn_name(target)
    for op in OPS.values():
        if name in op.torch_names and op.arity == 1 and not op.attrs and op.kind == OpKind.ELEMENTWISE:
            return op.name
    return None


def _rows(x: Any, concrete: Any, dim: Any = -1) -> bool:
    """Is this a call the row ops can take: a float tensor ``x`` reduced over its last dimension ``dim``
    to a result of its own dtype?"""
    return (isinstance(x, _T) and isinstance(concrete, torch.Tensor) and x.dtype == concrete.dtype
            and x.dtype in TORCH_DTYPES and isinstance(dim, int) and not isinstance(dim, bool)
            and dim in (-1, len(x.shape) - 1))


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class _Importer:
    name: str
    tracer: str
    gm: fx.GraphModule
    values: dict[fx.Node, Any]
    sources: list[tuple[str, Any]]  # per placeholder
    module: nn.Module | None = None
    b: GraphBuilder = field(init=False)
    env: dict[fx.Node, Any] = field(default_factory=dict)
    bindings: dict[tuple[Any, ...], Binding] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    opaque_names: list[str] = field(default_factory=list)
    opaque_kernels: int = 0
    emitted: dict[int, str] = field(default_factory=dict)  # id(_Program) -> IR id
    ids: set[str] = field(default_factory=set)

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

    def use(self, v: Any, hint: str, transpose: bool = False) -> str:
        """The IR id holding ``v`` (a tensor value), creating a graph input on first use."""
        if isinstance(v, _T) and v.program is not None:
            return self.materialise(v)
        if isinstance(v, _T) and v.id is not None and not transpose:
            return v.id
        if isinstance(v, _T):
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
        dtype = "fp32" if isinstance(v, _T) and v.dtype in INDEX_DTYPES else ir_dtype(v.dtype, f"tensor {name_base!r}")
        ir_shape = (shape[1], shape[0]) if transpose else flat_shape(shape)
        nid = self.fresh(name_base + (".T" if transpose else ""))
        self.b.input(nid, ir_shape, dtype)
        if tensor is not None:
            self.constants[nid] = _to_numpy(tensor, transpose)
            self.bindings[key] = Binding(nid, "const", hint, transpose, shape)
        else:
            assert isinstance(v, _T) and v.source is not None
            self.bindings[key] = Binding(nid, v.source[0], v.source[1], transpose, shape)
        return nid

    def emit(self, node: fx.Node, op: str, inputs: Sequence[str], attrs: Mapping[str, Any] | None,
             shape: Sequence[int], dtype: torch.dtype, suffix: str = "") -> _T:
        nid = self.fresh(node.name + suffix)
        try:
            self.b.op(nid, op, inputs, attrs)
        except GraphError as exc:
            raise TorchImportError(f"{self.where(node)}: {exc}") from None
        return _T(tuple(shape), dtype, True, nid)

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
                    _T(tuple(v.shape), v.dtype, False, source=("state", node.target), name=str(node.target))
                    if isinstance(v, torch.Tensor) else v
                )
            elif node.op in ("call_function", "call_method", "call_module"):
                self.env[node] = self.call(node)
            elif node.op == "output":
                return self.outputs(node)
        raise TorchImportError("traced graph has no output node")

    def source_value(self, node: fx.Node, source: tuple[str, Any]) -> Any:
        v = self.values[node]
        if not isinstance(v, torch.Tensor):
            raise TorchImportError(f"input {node.name!r} is a {type(v).__name__}; only tensor inputs are supported")
        if not (source[0] == "arg" and v.dtype in INDEX_DTYPES):
            ir_dtype(v.dtype, f"input {node.name!r}")
        name = str(source[1]) if source[0] == "state" else node.name
        return _T(tuple(v.shape), v.dtype, source[0] == "arg", source=source, name=name)

    def outputs(self, node: fx.Node) -> tuple[list[str], list[OutputSpec], Any]:
        leaves, tree = pytree.tree_flatten(node.args[0])
        outs: list[str] = []
        specs: list[OutputSpec] = []
        for i, leaf in enumerate(leaves):
            v = self.env.get(leaf) if isinstance(leaf, fx.Node) else leaf
            if not isinstance(v, (_T, torch.Tensor)):
                raise TorchImportError(f"output {i} is a {type(v).__name__}; only tensor outputs are supported")
            oid = self.use(v, f"out{i}")
            if oid not in outs:
                outs.append(oid)
            specs.append(OutputSpec(outs.index(oid), tuple(v.shape), v.dtype))
        return outs, specs, tree

    def arg(self, a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: self.env[n])

    def call(self, node: fx.Node) -> Any:
        """Map one call; an in-place op is mapped out of place and rebinds the tensor it mutated."""
        out = self._call(node)
        mutated = self.mutated_input(node)
        if mutated is not None and isinstance(out, (_T, torch.Tensor)):
            self.env[mutated] = out
        return out

    def mutated_input(self, node: fx.Node) -> fx.Node | None:
        return _mutated_input(self.gm, node)

    def _call(self, node: fx.Node) -> Any:
        args, kwargs = self.arg(node.args), self.arg(node.kwargs)
        if node.op == "call_module":
            return self.call_module(node, args, kwargs)
        fn_target: Any = node.target
        if self.mutated_input(node) is not None:
            if node.op == "call_method":
                fn_target = str(node.target)[:-1]
            fn_target = _INPLACE_OPERATORS.get(fn_target, fn_target)
            if "inplace" in kwargs:
                kwargs = {**kwargs, "inplace": False}
        target = ("method", fn_target) if node.op == "call_method" else fn_target
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, (_T, _Multi))]
        concrete = self.values[node]
        if not any(isinstance(x, _Multi) or x.runtime for x in leaves):
            return self.fold(node, concrete)
        if target in _METADATA_ASSERTIONS:
            return None  # it held on the example inputs, and a call with another dtype or shape is refused
        if not isinstance(concrete, torch.Tensor) and not isinstance(concrete, (tuple, list)):
            if _CANON.get(target) is None and target not in _SHAPE_QUERIES:
                raise TorchImportError(
                    f"{self.where(node)} turns a tensor into the Python value {concrete!r}: data-dependent "
                    "values cannot be planned; use torch.export with torch.cond, or keep the value a tensor"
                )
            return concrete  # a shape query: shapes are fixed at planning time
        if target in _SHAPE_QUERIES and not isinstance(concrete, torch.Tensor) and target is not operator.getitem:
            return concrete
        if target is operator.getitem and isinstance(args[0], _Multi):
            return self.opaque(node, args[0].impl, args[0].node, item=int(args[1]))
        if target is operator.getitem and not isinstance(args[0], _T):
            return concrete  # indexing a shape tuple
        if any(isinstance(x, _T) and x.dtype in INDEX_DTYPES for x in leaves):
            return self.generic(node, fn_target, args, kwargs)  # integer indices: only torch computes with them
        kind = _CANON.get(target)
        if kind is None:
            op = _op_for_torch_call(fn_target, args, kwargs)
            if op is not None and isinstance(concrete, torch.Tensor):
                return self.unary(node, op, args[0], concrete)
        handler = getattr(self, f"map_{kind}", None) if kind else None
        if handler is not None:
            out = handler(node, args, kwargs, concrete)
            if out is not None:
                return out
        return self.generic(node, fn_target, args, kwargs)

    def fold(self, node: fx.Node, concrete: Any) -> Any:
        """A value computed from constants and parameters only: captured at import."""
        if isinstance(concrete, torch.Tensor):
            return concrete.detach().clone()
        return concrete

    # -- mapped ops
    def unary(self, node: fx.Node, op: str, x: Any, concrete: torch.Tensor) -> _T | None:
        if not isinstance(x, _T):
            return None
        return self.emit(node, op, [self.use(x, node.name)], None, concrete.shape, concrete.dtype)

    def map_relu(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.unary(node, "Relu", args[0], concrete)

    def map_silu(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        if kwargs.get("inplace") or (len(args) > 1 and args[1]):
            return None
        return self.unary(node, "Silu", args[0], concrete)

    def map_gelu(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        approx = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
        op = {"tanh": "GeluTanh", "none": "GeluErf"}.get(approx)
        return self.unary(node, op, args[0], concrete) if op else None

    def map_linear(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        x = args[0]
        w = kwargs.get("weight", args[1] if len(args) > 1 else None)
        bias = kwargs.get("bias", args[2] if len(args) > 2 else None)
        if not isinstance(x, _T) or len(x.shape) < 2 or not _is_leaf_tensor(w) or len(w.shape) != 2:
            return None
        if bias is not None and (not _is_leaf_tensor(bias) or len(bias.shape) != 1):
            return None
        wname = w.name if isinstance(w, _T) else f"{node.name}_weight"
        mm = self.emit(node, "MatMul", [self.use(x, node.name), self.use(w, wname, transpose=True)], None,
                       concrete.shape, concrete.dtype, suffix="_mm" if bias is not None else "")
        if bias is None:
            return mm
        bname = bias.name if isinstance(bias, _T) else f"{node.name}_bias"
        return self.emit(node, "BiasAdd", [mm.id, self.use(bias, bname)], None, concrete.shape, concrete.dtype)

    def map_matmul(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        """``x @ w`` with ``w`` 2-D (a weight, or any stored matrix): one MatMul on ``x``'s rows.  Eager
        attention's 4-D products of head-major values: ``q @ k.transpose(-1, -2)`` is ``BatchScores``,
        ``p @ v`` is ``BatchApply``."""
        if len(args) != 2 or kwargs:
            return None
        if isinstance(concrete, torch.Tensor) and concrete.dim() == 4:
            return self.batched(node, args[0], args[1], concrete)
        return self.gemm(node, args[0], args[1], None, concrete)

    def batched(self, node: fx.Node, a: Any, b: Any, concrete: torch.Tensor) -> _T | None:
        if not (isinstance(a, _T) and isinstance(b, _T) and a.dtype == b.dtype == concrete.dtype in TORCH_DTYPES):
            return None
        a = self.settle(a)
        if a.id is None or self.b.shape_of(a.id) != _head_major(a.shape):
            return None
        keys = self.transposed_heads(node, b)
        if keys is not None:  # q @ k^T
            return self.emit(node, "BatchScores", [a.id, keys], {"causal": 0}, concrete.shape, concrete.dtype)
        b = self.settle(b)
        if b.id is not None and self.b.shape_of(b.id) == _head_major(b.shape):  # p @ v
            return self.emit(node, "BatchApply", [a.id, b.id], None, concrete.shape, concrete.dtype)
        return None

    def transposed_heads(self, node: fx.Node, t: _T) -> str | None:
        """The IR id of head-major keys when ``t`` is their ``transpose(-1, -2)`` still pending: of a head-major
        value, or of heads taken out of token rows in the same pending steps (then emitted as ``Heads``)."""
        p = t.program
        if p is None or len(p.inputs) != 1:
            return None
        step, n = p.steps[-1], len(p.steps)
        args = step.get("args")
        if (step.get("impl") not in ("torch.Tensor.transpose", "torch.transpose", "torch.ops.aten.transpose.int")
                or not isinstance(args, list) or len(args) != 3 or args[0] != ({"$in": 0} if n == 1 else {"$step": n - 2})
                or sorted(d % 4 for d in args[1:] if isinstance(d, int)) != [2, 3]):
            return None
        if n == 1:
            return p.inputs[0] if len(p.in_shapes[0]) == 4 and self.b.shape_of(p.inputs[0]) == _head_major(p.in_shapes[0]) else None
        split = head_split(p.steps[:-1], p.in_shapes)
        if split is None or self.b.shape_of(p.inputs[0]) != flat_shape(p.in_shapes[0]):
            return None
        layout = split[1]
        attrs = {"heads": layout.heads, "seq": layout.seq, "offset": layout.offset, "width": layout.width}
        shape = (t.shape[0], t.shape[1], t.shape[3], t.shape[2])  # the keys before their transpose
        return self.emit(node, "Heads", [p.inputs[0]], attrs, shape, t.dtype, "_keys").id

    def map_addmm(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        """``torch.addmm(b, x, w)`` (GPT-2's Conv1D) with a row-vector ``b``: MatMul + BiasAdd."""
        if len(args) != 3 or any(kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or set(kwargs) - {"beta", "alpha"}:
            return None
        bias, x, w = args
        if not _is_tensor(bias) or len(bias.shape) != 1:
            return None
        return self.gemm(node, x, w, bias, concrete)

    def gemm(self, node: fx.Node, x: Any, w: Any, bias: Any, concrete: Any) -> _T | None:
        if not (isinstance(x, _T) and len(x.shape) >= 2 and _is_tensor(w) and len(w.shape) == 2
                and isinstance(concrete, torch.Tensor) and x.dtype == w.dtype == concrete.dtype):
            return None
        wname = w.name if isinstance(w, _T) else f"{node.name}_weight"
        mm = self.emit(node, "MatMul", [self.use(x, node.name), self.use(w, wname)], None,
                       concrete.shape, concrete.dtype, suffix="_mm" if bias is not None else "")
        if bias is None:
            return mm
        bname = bias.name if isinstance(bias, _T) else f"{node.name}_bias"
        return self.emit(node, "BiasAdd", [self.use(mm, node.name), self.use(bias, bname)], None, concrete.shape, concrete.dtype)

    def affine(self, node: fx.Node, x: _T, a: float, b: float, concrete: torch.Tensor, suffix: str = "") -> _T:
        return self.emit(node, "Affine", [self.use(x, node.name)], {"a": float(a), "b": float(b)},
                         concrete.shape, concrete.dtype, suffix)

    def binary(self, node, args, kwargs, concrete, kind):  # noqa: ANN001, ANN201
        if kwargs.get("alpha", 1) != 1 or len(args) != 2 or kwargs.get("rounding_mode") is not None:
            return None
        a, c = args
        if not isinstance(concrete, torch.Tensor):
            return None
        if isinstance(a, _T) and _is_scalar(c):
            coef = {"add": (1.0, c), "sub": (1.0, -c), "mul": (c, 0.0), "div": (1.0 / c if c else None, 0.0)}[kind]
            return None if coef[0] is None else self.affine(node, a, coef[0], coef[1], concrete)
        if isinstance(c, _T) and _is_scalar(a):
            coef = {"add": (1.0, a), "sub": (-1.0, a), "mul": (a, 0.0), "div": (None, 0.0)}[kind]
            return None if coef[0] is None else self.affine(node, c, coef[0], coef[1], concrete)
        if not (_is_tensor(a) and _is_tensor(c)):
            return None
        if a.dtype != c.dtype:  # torch computes in the promoted dtype (bf16 * fp32 is fp32)
            a, c = self.cast(node, a, concrete.dtype) or a, self.cast(node, c, concrete.dtype) or c
            if a.dtype != c.dtype:
                return None
        out = tuple(concrete.shape)
        a, c = self.settle(a), self.settle(c)
        if tuple(a.shape) == tuple(c.shape) == out:
            op = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "maximum": "Maximum", "minimum": "Minimum"}[kind]
            ia, ic = self.use(a, node.name), self.use(c, f"{node.name}_rhs")
            if self.b.shape_of(ia) != self.b.shape_of(ic):
                return None  # one head-major, one in token rows: torch computes it (an Opaque takes both)
            return self.emit(node, op, [ia, ic], None, out, concrete.dtype)
        row_vector = {"add": "BiasAdd", "mul": "BiasMul"}.get(kind)
        if row_vector and len(out) >= 2:
            for x, vec in ((a, c), (c, a)):
                if tuple(x.shape) == out and tuple(vec.shape) == (out[-1],):
                    return self.emit(node, row_vector, [self.use(x, node.name), self.use(vec, f"{node.name}_rhs")],
                                     None, out, concrete.dtype)
        tiled = {"add": "TileAdd", "mul": "TileMul"}.get(kind)
        if tiled and len(out) >= 3:  # RoPE's x * cos: a (1, .., 1, seq, d) table over (batch, heads, seq, d)
            for x, t in ((a, c), (c, a)):
                if tuple(x.shape) == out and self.tiles(x, t, out):
                    return self.emit(node, tiled, [self.use(x, node.name), self.use(t, f"{node.name}_rhs")], None, out,
                                     concrete.dtype)
        if kind == "add" and len(out) == 4:  # eager attention's scores + attention_mask
            for x, m in ((a, c), (c, a)):
                masked = self.masked_scores(node, x, m, out, concrete.dtype)
                if masked is not None:
                    return masked
        if kind in ("add", "sub", "mul", "div") and len(out) >= 1:  # one value per row, e.g. x - x.mean(-1, keepdim=True)
            per_row = (*out[:-1], 1)
            pairs = ((a, c), (c, a)) if kind in ("add", "mul") else ((a, c),)
            for x, r in pairs:
                if tuple(x.shape) == out and tuple(r.shape) == per_row and out[-1] != 1:
                    op = {"add": "AddRow", "sub": "SubRow", "mul": "MulRow", "div": "DivRow"}[kind]
                    return self.emit(node, op, [self.use(x, node.name), self.use(r, f"{node.name}_row")], None, out,
                                     concrete.dtype)
        return None

    def settle(self, v: Any) -> Any:
        """``v``, emitted now when it is a pending torch program that is an op-table layout op (``Heads``,
        ``RotateHalf``, ``Merge``): its consumer then sees the IR value and its layout."""
        if not (isinstance(v, _T) and v.program is not None and v.dtype in TORCH_DTYPES):
            return v
        p = v.program
        if id(p) not in self.emitted:
            layout = self.layout_op(p, v)
            if layout is None:
                return v
            self.emitted[id(p)] = layout
        return _T(v.shape, v.dtype, v.runtime, self.emitted[id(p)])

    def tiles(self, x: Any, t: Any, out: tuple[int, ...]) -> bool:
        """Does ``t`` broadcast over ``x`` (shape ``out``) as a tile of its trailing dimensions, leading ones 1,
        with the IR shapes of ``x`` ending in that tile (a head-major value: (batch * heads, seq, d)) and of ``t``
        being it (a constant, a call input or parameter, or a computed value: RoPE's cos and sin)?"""
        shape = tuple(t.shape)
        core = shape[next((i for i, d in enumerate(shape) if d != 1), len(shape)):]
        if len(core) < 2 or len(core) >= len(out) or out[len(out) - len(core):] != core or t.dtype not in TORCH_DTYPES:
            return False
        if any(d != 1 for d in shape[:len(shape) - len(core)]):
            return False
        if isinstance(t, _T) and t.program is not None:
            return False  # a pending torch value: its layout is not known until it is emitted
        t_ir = self.b.shape_of(t.id) if isinstance(t, _T) and t.id is not None else flat_shape(shape)
        ir = self.b.shape_of(x.id) if isinstance(x, _T) and x.id is not None else None
        return ir is not None and len(ir) > len(core) and tuple(ir[len(ir) - len(core):]) == core == tuple(t_ir)

    def map_add(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.binary(node, args, kwargs, concrete, "add")

    def map_sub(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.binary(node, args, kwargs, concrete, "sub")

    def map_mul(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.binary(node, args, kwargs, concrete, "mul")

    def map_div(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.binary(node, args, kwargs, concrete, "div")

    # -- rows: reductions over the last dimension and what is made of them.  In a 16-bit graph an unfused
    # plan stores the row statistics in 16 bits, where torch keeps them in fp32; a fused row kernel keeps
    # them in fp32 registers, as torch does.  Both are candidates; the output check judges each.
    def reduction(self, node, args, kwargs, concrete, op):  # noqa: ANN001, ANN201
        """``x.mean(-1, keepdim=True)`` (``sum``, ``amax``): the op-table reduction over the last dimension."""
        x = args[0] if args else kwargs.get("input")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
        if len(dims) != 1 or not _rows(x, concrete, dims[0]) or keep is not True or kwargs.get("dtype"):
            return None
        return self.emit(node, op, [self.use(x, node.name)], None, concrete.shape, concrete.dtype)

    def map_mean(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.reduction(node, args, kwargs, concrete, "RowMean")

    def map_sum(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.reduction(node, args, kwargs, concrete, "RowSum")

    def map_amax(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.reduction(node, args, kwargs, concrete, "RowMax")

    def map_softmax(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        """softmax over the last dimension: exp(x - max) / sum, one row kernel once fused."""
        x = args[0] if args else kwargs.get("input")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        extra = args[2] if len(args) > 2 else None  # aten.softmax.int's dtype, or aten._softmax's half_to_float
        want = extra if isinstance(extra, torch.dtype) else kwargs.get("dtype")
        if (not _rows(x, concrete, dim) or (want is not None and want != x.dtype)  # eager attention's dtype=float32
                or (extra not in (None, False) and not isinstance(extra, torch.dtype))):
            return None
        shape, dt, stat = concrete.shape, concrete.dtype, (*concrete.shape[:-1], 1)
        xi = self.use(x, node.name)
        top = self.emit(node, "RowMax", [xi], None, stat, dt, "_max")
        e = self.emit(node, "Exp", [self.emit(node, "SubRow", [xi, top.id], None, shape, dt, "_shift").id], None,
                      shape, dt, "_exp")
        total = self.emit(node, "RowSum", [e.id], None, stat, dt, "_sum")
        return self.emit(node, "DivRow", [e.id, total.id], None, shape, dt)

    def map_sdpa(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        """``scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)`` of heads taken out of token rows
        (``split``/``view``/``transpose``): ``Heads`` of each, softmax(scale * q@k^T) @ v from ``BatchScores``,
        ``Affine``, the row ops and ``BatchApply`` (no dropout).  An ``attn_mask`` broadcast over the heads
        ((batch or 1, 1, seq or 1, keys); float, or a constant bool one as 0 / -inf) is repeated over the groups
        (``GroupRepeat``) and added to the scaled scores (``MaskAdd``; ``Add`` for a mask per query).  The rules
        fuse it into one ``Attention`` (``MaskedAttention``) kernel; the heads are merged back where the result
        is transposed and reshaped."""
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args, strict=False)) | kwargs
        if (set(bound) - set(names) or bound.get("dropout_p", 0.0) != 0.0
                or not isinstance(bound.get("enable_gqa", False), bool)
                or not isinstance(bound.get("is_causal", False), bool)):
            return None
        if bound.get("attn_mask") is not None and bound.get("is_causal"):
            return None  # torch refuses both
        qkv = [bound.get(n) for n in names[:3]]
        if not all(isinstance(t, _T) and t.dtype == concrete.dtype and len(t.shape) == 4 for t in qkv):
            return None
        if concrete.dtype not in TORCH_DTYPES or not all(self.head_major(t) for t in qkv):
            return None
        scale = bound.get("scale")
        scale = 1.0 / math.sqrt(qkv[0].shape[-1]) if scale is None else scale  # torch's default: 1/sqrt(head dim)
        if not _is_scalar(scale):
            return None
        scores_shape = (*qkv[0].shape[:-1], qkv[1].shape[-2])
        mask = bound.get("attn_mask")
        mask_layout = None if mask is None else self.mask_layout(mask, scores_shape, concrete.dtype)
        if mask is not None and mask_layout is None:
            return None
        q, k, v = (self.use(t, f"{node.name}_{name}") for t, name in zip(qkv, "qkv", strict=True))
        heads, kv_heads = qkv[0].shape[1], qkv[1].shape[1]
        if kv_heads != heads:  # grouped-query attention: each key and value head repeated for its query heads
            if not bound.get("enable_gqa") or qkv[2].shape[1] != kv_heads or heads % kv_heads:
                return None
            k, v = (self.emit(node, "GroupRepeat", [t_id], {"heads": heads // kv_heads, "rows": t.shape[2]},
                              (t.shape[0], heads, *t.shape[2:]), t.dtype, f"_{name}_repeated").id
                    for t_id, t, name in ((k, qkv[1], "k"), (v, qkv[2], "v")))
        stat, dt = (*scores_shape[:-1], 1), concrete.dtype
        scores = self.emit(node, "BatchScores", [q, k], {"causal": int(bound.get("is_causal", False))}, scores_shape,
                           dt, "_scores")
        scaled = self.emit(node, "Affine", [scores.id], {"a": float(scale), "b": 0.0}, scores_shape, dt, "_scaled")
        if mask is not None:
            masked = self.masked_scores(node, scaled, mask, scores_shape, dt)
            assert masked is not None  # its layout was checked above
            scaled = masked
        top = self.emit(node, "RowMax", [scaled.id], None, stat, dt, "_max")
        e = self.emit(node, "Exp", [self.emit(node, "SubRow", [scaled.id, top.id], None, scores_shape, dt, "_shift").id],
                      None, scores_shape, dt, "_exp")
        probs = self.emit(node, "DivRow", [e.id, self.emit(node, "RowSum", [e.id], None, stat, dt, "_sum").id], None,
                          scores_shape, dt, "_probs")
        return self.emit(node, "BatchApply", [probs.id, v], None, concrete.shape, dt)

    def masked_scores(self, node: fx.Node, x: Any, mask: Any, out: tuple[int, ...], dtype: torch.dtype) -> _T | None:
        """``x + mask`` for head-major scores ``x`` (batch, heads, S, T) and an attention mask broadcast over the
        heads: the mask repeated over the groups (``GroupRepeat``), then ``MaskAdd`` (``Add`` for one row per
        query).  None where ``x`` is no such value or the mask no such mask."""
        if not (isinstance(x, _T) and x.id is not None and tuple(x.shape) == out
                and self.b.shape_of(x.id) == _head_major(out)):
            return None
        layout = self.mask_layout(mask, out, dtype)
        if layout is None:
            return None
        value, batches, rows = layout
        b, h = out[:2]
        repeated = self.emit(node, "GroupRepeat", [self.use(value, f"{node.name}_mask")],
                             {"heads": b * h // batches, "rows": rows}, (b, h, rows, out[-1]), dtype, "_mask")
        assert repeated.id is not None
        return self.emit(node, "MaskAdd" if rows == 1 else "Add", [x.id, repeated.id], None, out, dtype)

    def mask_layout(self, mask: Any, scores: tuple[int, ...], dtype: torch.dtype) -> tuple[Any, int, int] | None:
        """(mask value, its batches, its rows) for an ``attn_mask`` the op table can add to ``scores`` (batch,
        heads, S, T): shape (batches, 1, rows, T) after torch's left padding with 1s, batches 1 or the batch, rows
        1 or S; float of the scores' dtype, or a constant bool mask, then 0 where kept and -inf elsewhere."""
        if not isinstance(mask, (_T, torch.Tensor)) or len(mask.shape) > 4:
            return None
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, -math.inf)  # what torch's bool mask means
        if mask.dtype != dtype or (isinstance(mask, _T) and mask.program is not None):
            return None
        shape = (1,) * (4 - len(mask.shape)) + tuple(mask.shape)
        b, _, s, t = scores
        if shape[1] != 1 or shape[3] != t or shape[0] not in (1, b) or shape[2] not in (1, s):
            return None
        flat = (shape[0] * shape[2], t)
        if isinstance(mask, _T) and mask.id is not None and self.b.shape_of(mask.id) != flat:
            return None
        if isinstance(mask, torch.Tensor):
            mask = mask.reshape(flat)  # bound as the (batches * rows, T) the op reads
        elif flat_shape(mask.shape) != flat:
            return None
        return mask, shape[0], shape[2]

    def head_major(self, t: _T) -> bool:
        """Is ``t`` (batch, heads, seq, d) in the op table's head-major layout: an IR value of shape
        (batch * heads, seq, d), or heads taken out of token rows still pending (``Heads`` once used)?"""
        if t.program is not None:
            p = t.program
            return (head_split(p.steps, p.in_shapes) is not None and len(p.inputs) == 1
                    and self.b.shape_of(p.inputs[0]) == flat_shape(p.in_shapes[0]))
        return t.id is not None and self.b.shape_of(t.id) == _head_major(t.shape)

    def norm(self, node, x, shape, weight, bias, eps, concrete, rms):  # noqa: ANN001, ANN201
        """LayerNorm (``rms``: RMSNorm) over the last dimension as the ops it is made of: the row
        statistics, ``(x - mean) * rsqrt(var + eps)`` (``x * rsqrt(mean(x*x) + eps)``), weight, bias."""
        if not _rows(x, concrete) or tuple(shape or ()) != (x.shape[-1],):
            return None
        eps = float(torch.finfo(x.dtype).eps if eps is None else eps)  # torch's default: the input dtype's
        full, dt, stat = concrete.shape, concrete.dtype, (*concrete.shape[:-1], 1)
        xi = centred = self.use(x, node.name)
        if not rms:
            mean = self.emit(node, "RowMean", [xi], None, stat, dt, "_mean")
            centred = self.emit(node, "SubRow", [xi, mean.id], None, full, dt, "_centred").id
        square = self.emit(node, "Square", [centred], None, full, dt, "_square")
        var = self.emit(node, "RowMean", [square.id], None, stat, dt, "_var")
        inv = self.emit(node, "Rsqrt", [self.emit(node, "Affine", [var.id], {"a": 1.0, "b": eps}, stat, dt, "_eps").id],
                        None, stat, dt, "_rstd")
        y = self.emit(node, "MulRow", [centred, inv.id], None, full, dt, "_normed" if weight is not None or bias is not None else "")
        if weight is not None:
            y = self.emit(node, "BiasMul", [y.id, self.use(weight, f"{node.name}_weight")], None, full, dt,
                          "_scaled" if bias is not None else "")
        if bias is not None:
            y = self.emit(node, "BiasAdd", [y.id, self.use(bias, f"{node.name}_bias")], None, full, dt)
        return y

    def map_layer_norm(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        names = ("input", "normalized_shape", "weight", "bias", "eps")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        if set(a) - set(names):
            return None
        return self.norm(node, a.get("input"), a.get("normalized_shape"), a.get("weight"), a.get("bias"),
                         a.get("eps", 1e-5), concrete, rms=False)

    def map_rms_norm(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        names = ("input", "normalized_shape", "weight", "eps")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        if set(a) - set(names):
            return None
        return self.norm(node, a.get("input"), a.get("normalized_shape"), a.get("weight"), None, a.get("eps"),
                         concrete, rms=True)

    def map_maximum(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.binary(node, args, kwargs, concrete, "maximum") if all(_is_tensor(a) for a in args) else None

    def map_minimum(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.binary(node, args, kwargs, concrete, "minimum") if all(_is_tensor(a) for a in args) else None

    def map_neg(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        x = args[0] if args else None
        if isinstance(x, _T) and x.program is not None and takes_columns(x.program.steps[-1]):
            return None  # -x[..., d/2:] of rotate_half: kept with its slice, so the cat is recognised as a whole
        return self.unary(node, "Neg", x, concrete)

    def map_pow(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        """``x ** p`` with a constant ``p`` of 2, 3, 0.5 or -0.5: Square, Square then Mul, Sqrt, Rsqrt."""
        if len(args) != 2 or kwargs or not isinstance(args[0], _T) or not _is_scalar(args[1]):
            return None
        x, p = args[0], float(args[1])
        if not isinstance(concrete, torch.Tensor):
            return None
        ops = {2.0: "Square", 0.5: "Sqrt", -0.5: "Rsqrt"}
        if p in ops:
            return self.unary(node, ops[p], x, concrete)
        if p == 3.0:
            sq = self.emit(node, "Square", [self.use(x, node.name)], None, concrete.shape, concrete.dtype, "_sq")
            return self.emit(node, "Mul", [sq.id, self.use(x, f"{node.name}_x")], None, concrete.shape, concrete.dtype)
        return None

    def map_rsub(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        if isinstance(args[0], _T) and _is_scalar(args[1]) and _is_scalar(alpha):
            return self.affine(node, args[0], -float(alpha), float(args[1]), concrete)
        return None

    def alias(self, x: Any, concrete: Any) -> _T | None:
        """The same IR tensor seen with another torch shape (no node, no copy)."""
        if not isinstance(x, _T) or not isinstance(concrete, torch.Tensor) or concrete.dtype != x.dtype:
            return None
        if flat_shape(concrete.shape) != flat_shape(x.shape):
            return None
        if x.program is not None and tuple(concrete.shape) == x.shape:
            return x  # contiguous(), clone(), .to(same dtype) of a pending torch-backed value: still pending
        if x.program is not None:
            x = _T(x.shape, x.dtype, x.runtime, self.materialise(x))
        if x.id is None:
            if concrete.shape == x.shape:
                return _T(tuple(concrete.shape), x.dtype, x.runtime, None, x.source, x.name)
            if x.source is None or x.dtype not in TORCH_DTYPES:
                return None  # an integer input stays torch's (an Opaque embedding reads it)
            # a call input or parameter seen with another shape (GPT-2's x.view(-1, d)): bind it, then alias
            return _T(tuple(concrete.shape), x.dtype, x.runtime, self.use(x, x.name or "view"))
        return _T(tuple(concrete.shape), x.dtype, x.runtime, x.id)

    def map_view(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.alias(args[0], concrete)

    def map_same(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        return self.alias(args[0], concrete)

    def map_to(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        x = args[0] if args else None
        if isinstance(x, _T) and isinstance(concrete, torch.Tensor) and concrete.dtype != x.dtype:
            return self.cast(node, x, concrete.dtype) if concrete.shape == x.shape else None
        return self.alias(x, concrete)

    def cast(self, node: fx.Node, v: Any, dtype: torch.dtype) -> _T | None:
        """Tensor value ``v`` as ``dtype``: itself, or the op-table Cast between float dtypes (``x.to(dtype)``, a
        binary op's operand as torch promotes it); None for anything else (integer indices stay torch's)."""
        if not isinstance(v, _T) or v.dtype not in TORCH_DTYPES or dtype not in TORCH_DTYPES:
            return None
        if v.dtype == dtype:
            return v
        return self.emit(node, "Cast", [self.use(v, node.name)], {"dtype": TORCH_DTYPES[dtype]}, v.shape, dtype,
                         "_cast")

    def map_expand(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        """``repeat_kv``'s ``x[:, :, None].expand(b, kv, n, t, d)`` of head-major keys or values (grouped-query
        attention): ``GroupRepeat``, each head repeated for its n query heads (the reshape after it is free)."""
        x = self.settle(args[0]) if args else None
        if not (isinstance(x, _T) and x.id is not None and isinstance(concrete, torch.Tensor) and len(x.shape) == 5):
            return None
        b, kv, one, t, d = x.shape
        out = tuple(concrete.shape)
        if one != 1 or out[:2] != (b, kv) or out[3:] != (t, d) or self.b.shape_of(x.id) != (b * kv, t, d):
            return None
        return self.emit(node, "GroupRepeat", [x.id], {"heads": out[2], "rows": t}, out, x.dtype)

    def map_dropout(self, node, args, kwargs, concrete):  # noqa: ANN001, ANN201
        train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        if train and p:
            raise TorchImportError(f"{self.where(node)}: dropout in training mode is random; call module.eval() first")
        return self.alias(args[0], concrete)

    def call_module(self, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        m = self.gm.get_submodule(str(node.target))
        concrete = self.values[node]
        x = args[0]
        if not isinstance(x, _T) or not x.runtime:
            return self.fold(node, concrete)

        def state(attr: str) -> _T | None:
            t = getattr(m, attr, None)
            if t is None:
                return None
            key = f"{node.target}.{attr}"
            return _T(tuple(t.shape), t.dtype, False, source=("state", key), name=key)

        if isinstance(m, nn.Linear):
            return self.map_linear(node, (x, state("weight"), state("bias")), {}, concrete)
        if isinstance(m, nn.GELU):
            return self.map_gelu(node, (x,), {"approximate": m.approximate}, concrete)
        if isinstance(m, nn.ReLU):
            return self.unary(node, "Relu", x, concrete)
        if isinstance(m, nn.SiLU):
            return self.unary(node, "Silu", x, concrete)
        if isinstance(m, (nn.Dropout, nn.Identity)):
            if isinstance(m, nn.Dropout) and m.training and m.p:
                raise TorchImportError(f"{self.where(node)}: dropout in training mode is random; call module.eval() first")
            return self.alias(x, concrete)
        assert isinstance(m, nn.LayerNorm)
        call_args = (x, tuple(m.normalized_shape), state("weight"), state("bias"), float(m.eps))
        return (self.norm(node, *call_args, concrete, rms=False)
                or self.opaque_call(node, "torch.nn.functional.layer_norm", call_args, {}, concrete))

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
            return _Multi(node, name, concrete)
        return self.opaque_call(node, name, args, kwargs, concrete)

    def opaque(self, getitem: fx.Node, impl: str, call_node: fx.Node, item: int) -> _T:
        args, kwargs = self.arg(call_node.args), self.arg(call_node.kwargs)
        return self.opaque_call(getitem, impl, args, kwargs, self.values[getitem], item=item)

    def opaque_call(self, node: fx.Node, impl: str, args: Any, kwargs: Any, concrete: Any, item: int = -1) -> _T:
        """A torch call as an Opaque node; single-use torch-backed inputs are folded into its steps."""
        if not isinstance(concrete, torch.Tensor):
            raise TorchImportError(f"{self.where(node)} returns a {type(concrete).__name__}, not a tensor")
        ir_dtype(concrete.dtype, f"the result of {self.where(node)}")
        try:
            resolve_torch_fn(impl)
        except OpError as exc:
            raise TorchImportError(f"{self.where(node)}: {exc}") from None
        inputs: list[str] = []
        in_shapes: list[tuple[int, ...]] = []
        steps: list[dict[str, Any]] = []
        folded: dict[int, int] = {}  # id(_Program) -> its last step here

        def add_input(nid: str, shape: tuple[int, ...]) -> int:
            if nid not in inputs:
                inputs.append(nid)
                in_shapes.append(shape)
            return inputs.index(nid)

        def fold(p: _Program) -> int:
            if id(p) not in folded:
                base = len(steps)
                remap = {k: add_input(nid, shp) for k, (nid, shp) in enumerate(zip(p.inputs, p.in_shapes, strict=True))}
                steps.extend(_renumber(st, remap, base) for st in p.steps)
                folded[id(p)] = len(steps) - 1
            return folded[id(p)]

        shapes: list[list[int]] = []

        def ref(v: Any) -> dict[str, int] | None:
            is_float = isinstance(v, torch.Tensor) and v.dtype in TORCH_DTYPES
            if not isinstance(v, _T) and not is_float:
                return None
            shapes.append(list(v.shape))
            if isinstance(v, _T) and v.program is not None and len(v.program.node.users) == 1:
                return {"$step": fold(v.program)}
            ref_in = {"$in": add_input(self.use(v, f"{node.name}_const{len(inputs)}"), tuple(v.shape))}
            if isinstance(v, _T) and v.dtype in INDEX_DTYPES:  # bound as fp32: the indices again, as torch takes them
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
        value = _T(tuple(concrete.shape), concrete.dtype, True,
                   program=_Program(node, tuple(steps), tuple(inputs), tuple(in_shapes)))
        users = list(node.users)
        if len(users) == 1 and users[0].op != "output":
            return value  # emitted when its consumer is not torch-backed
        return _T(value.shape, value.dtype, True, self.materialise(value))

    def materialise(self, v: _T) -> str:
        """Emit a pending torch-backed value as one Opaque node (once)."""
        p = v.program
        assert p is not None
        if id(p) not in self.emitted and v.dtype in TORCH_DTYPES:
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


    def layout_op(self, p: _Program, v: _T) -> str | None:
        """The op-table layout op a pending torch program is, emitted: heads merged back (``Merge``), heads taken
        out of token rows (``Heads``), RoPE's ``RotateHalf``; None when it is none of them."""
        in_ir = self.b.shape_of(p.inputs[0]) if len(p.inputs) == 1 else None
        heads = head_merge(p.steps, p.in_shapes, v.shape)
        if heads is not None and in_ir == _head_major(p.in_shapes[0]):
            return self.emit(p.node, "Merge", [p.inputs[0]], {"heads": heads}, v.shape, v.dtype).id
        split = head_split(p.steps, p.in_shapes)
        if split is not None and in_ir == flat_shape(p.in_shapes[0]):
            layout = split[1]
            attrs = {"heads": layout.heads, "seq": layout.seq, "offset": layout.offset, "width": layout.width}
            return self.emit(p.node, "Heads", [p.inputs[0]], attrs, v.shape, v.dtype).id
        if rotate_half(p.steps, p.in_shapes, v.shape) and in_ir is not None and in_ir[-1] == v.shape[-1]:
            return self.emit(p.node, "RotateHalf", [p.inputs[0]], None, v.shape, v.dtype).id
        return None


def _renumber(step: dict[str, Any], inputs: Mapping[int, int], base: int) -> dict[str, Any]:
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


def _head_major(shape: Sequence[int]) -> tuple[int, ...]:
    """The IR shape of a (batch, heads, seq, d) value the op table computes: (batch * heads, seq, d)."""
    b, h, s, d = shape
    return (b * h, s, d)


def _is_tensor(v: Any) -> bool:
    return isinstance(v, (_T, torch.Tensor))


def _is_leaf_tensor(v: Any) -> bool:
    """A tensor the importer can bind as a graph input (possibly transposed)."""
    return isinstance(v, torch.Tensor) or (isinstance(v, _T) and v.source is not None)


# ---------------------------------------------------------------- entry points


def _check_example_inputs(module: Any, args: tuple[Any, ...]) -> None:
    flat, _ = pytree.tree_flatten(args)
    if not flat:
        raise TorchImportError("no example inputs: pass the tensors the model is called with")
    for i, t in enumerate(flat):
        if not isinstance(t, torch.Tensor):
            raise TorchImportError(f"example input {i} is a {type(t).__name__}; only tensors are supported")
        if t.dtype not in INDEX_DTYPES:
            ir_dtype(t.dtype, f"example input {i}")
    if isinstance(module, nn.Module):
        try:
            inspect.signature(module.forward).bind(*args)
        except TypeError as exc:
            raise TorchImportError(
                f"example inputs do not match {type(module).__name__}.forward{inspect.signature(module.forward)}: {exc}"
            ) from None
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if p.is_floating_point():
                ir_dtype(p.dtype, f"parameter {name!r}")


def import_module(module: nn.Module | torch.export.ExportedProgram, example_inputs: Any, *, strategy: str = "auto") -> ImportedModule:
    """Trace ``module`` on ``example_inputs`` and map it to the IR (see the module docstring)."""
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    _check_example_inputs(module, args)
    try:
        gm, ph_values, tracer, sources, out_spec = _trace(module, args, strategy)
        if sources is None:
            sources = [("arg", i) for i in range(len(ph_values))]
        name = type(module).__name__ if isinstance(module, nn.Module) else "exported"
        return _import_graph(gm, ph_values, sources, tracer, name, out_spec)
    except TorchImportError:
        _check_inputs_fit(module, args)  # the module itself failing on them is the error to report
        raise


def _check_inputs_fit(module: nn.Module | torch.export.ExportedProgram, args: tuple[Any, ...]) -> None:
    """Run the module eagerly (only once an import failed: the recorder has already run it once)."""
    if not isinstance(module, nn.Module):
        return
    try:
        with torch.no_grad():
            module(*args)
    except Exception as exc:
        raise TorchImportError(f"example inputs do not fit {type(module).__name__}: {_first_line(exc)}") from None


def _import_graph(gm: fx.GraphModule, ph_values: Sequence[Any], sources: list[tuple[str, Any]], tracer: str, name: str,
                  out_spec: Any = None) -> ImportedModule:
    rec = _Recorder(gm)
    try:
        with torch.no_grad():
            rec.run(*ph_values)
    except Exception as exc:
        raise TorchImportError(f"running the traced graph on the example inputs failed: {_first_line(exc)}") from None
    imp = _Importer(name, tracer, gm, rec.values, sources)
    outs, specs, tree = imp.run()
    try:
        graph = imp.b.build(outs)
    except GraphError as exc:
        raise TorchImportError(f"{name}: {exc}") from None
    graph, bindings = _packed_projections(graph, imp)
    arg_specs = tuple((tuple(v.shape), v.dtype) for v, s in zip(ph_values, sources, strict=False) if s[0] == "arg")
    if imp.opaque_names:
        counts: dict[str, int] = {}
        for o in imp.opaque_names:
            counts[o] = counts.get(o, 0) + 1
        log.info("%s: %d op(s) stayed opaque (executed by torch, in %d Opaque kernel(s)): %s", name,
                 len(imp.opaque_names), imp.opaque_kernels, ", ".join(f"{k} x{v}" for k, v in counts.items()))
    return ImportedModule(
        graph=graph,
        bindings=bindings,
        constants=dict(imp.constants),
        arg_specs=arg_specs,
        outputs=tuple(specs),
        out_tree=tree if out_spec is None else out_spec,
        opaque_ops=tuple(imp.opaque_names),
        tracer=tracer,
    )


def _packed_projections(graph: Graph, imp: _Importer) -> tuple[Graph, tuple[Binding, ...]]:
    """The graph with projections of one input packed into one GEMM (torch.projections), and its bindings."""
    state = {b.name: b for b in imp.bindings.values() if b.source == "state"}

    def packable(name: str) -> bool:  # a Linear weight read as (K, N), or a bias
        b = state.get(name)
        return b is not None and (b.transpose or len(b.shape) == 1)

    graph, packs = pack_projections(graph, packable, imp.fresh)
    parts = {p for pack in packs for p in pack.parts}
    bindings = [b for b in imp.bindings.values() if b.name not in parts]
    for pack in packs:
        first = state[pack.parts[0]]
        bindings.append(Binding(pack.name, "packed", tuple(str(state[p].key) for p in pack.parts), first.transpose,
                                tuple(graph[pack.name].type.shape)))
    gemms = sum(1 for pack in packs if state[pack.parts[0]].transpose)
    if gemms:
        log.info("%s: %d set(s) of projections of one input packed into one GEMM each", imp.name, gemms)
    return graph, tuple(bindings)


def import_fx_graph(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], name: str = "dynamo") -> ImportedModule:
    """Import a graph captured by torch.compile: every placeholder is a call input."""
    sources = [("arg", i) for i in range(len(example_inputs))]
    return _import_graph(gm, list(example_inputs), sources, "dynamo", name)


def factory_kwargs(pairs: Sequence[str]) -> dict[str, Any]:
    """``NAME=VALUE`` pairs (the CLI's ``--torch-arg``) as keyword arguments: a VALUE that reads as a JSON
    number, boolean or null is that, anything else is a string."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.isidentifier():
            raise TorchImportError(f"--torch-arg expects NAME=VALUE with NAME an identifier, got {pair!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[name] = value if isinstance(value, (int, float, bool, type(None))) else raw
    return out


def load_factory(spec: str, kwargs: Mapping[str, Any] | None = None) -> tuple[Any, Any]:
    """Run ``path/file.py:factory(**kwargs)``; it must return ``(module, example_inputs)``."""
    path, sep, fname = spec.rpartition(":")
    if not sep or not path or not fname:
        raise TorchImportError(f"--torch expects FILE.py:FACTORY, got {spec!r}")
    p = Path(path)
    if not p.is_file():
        raise TorchImportError(f"torch model file not found: {p}")
    mod_spec = importlib.util.spec_from_file_location(f"_fusion_planner_model_{p.stem}", p)
    if mod_spec is None or mod_spec.loader is None:
        raise TorchImportError(f"cannot load {p} as a Python module")
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    factory = getattr(mod, fname, None)
    if not callable(factory):
        raise TorchImportError(f"{p} has no callable {fname!r}")
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise TorchImportError(f"{spec} does not take the arguments {sorted(kwargs)}: {exc}") from None
    out = factory(**kwargs)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module)):
        raise TorchImportError(f"{spec}: the factory must return (module, example_inputs)")
    return out


def graph_from_factory(spec: str, kwargs: Mapping[str, Any] | None = None) -> Graph:
    """The IR graph of ``FILE.py:FACTORY`` called with ``kwargs`` (the CLI's ``--torch``, ``--torch-arg``)."""
    module, inputs = load_factory(spec, kwargs)
    return import_module(module, inputs).graph


__all__ = [
    "Binding", "BoundInputs", "ImportedModule", "OutputSpec", "graph_from_factory", "graph_inputs_from_module",
    "factory_kwargs",
    "import_fx_graph", "import_module", "ir_dtype", "load_factory",
]

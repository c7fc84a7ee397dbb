"""Torch-backed Opaque implementations: ops the rules do not know, executed by torch.

An imported op that the planner cannot express in the op table becomes an
``Opaque`` node whose ``impl`` is the op's stable dotted name (for example
``torch.nn.functional.layer_norm``, ``torch.Tensor.view`` or
``torch.ops.aten.softmax.int``) and whose ``call`` attribute is JSON:
``{"steps": [...], "in": [torch shapes of the inputs], "out": torch shape}``.
Each step names one allowed function and holds its non-tensor arguments, with
tensors as ``{"$in": k}`` (the node's k-th input) or ``{"$step": j}`` (an
earlier step's result); the last step's result is the node's value.  Torch
calls whose result has a single torch-backed consumer are folded into that
consumer's steps (split/view/transpose around an attention call become one
kernel); the node's ``impl`` names its heaviest step.  A saved graph or plan
therefore names functions and never pickles them.

Which names may be looked up (also when a saved plan is loaded in a fresh
process) is decided by namespace in :func:`resolve_torch_fn`: native tensor
functions of ``torch``, ``torch.nn.functional``, ``torch._C._nn``,
``torch.special``, ``torch.linalg``, ``torch.ops.aten`` overloads, public
``torch.Tensor`` methods minus a deny list, and the arithmetic of ``operator``.
File I/O, serialization and Python-level helpers are not reachable.

IR tensors are stored flattened to at most two dims (see
:func:`flat_shape`); an implementation reshapes its inputs to the recorded
torch shapes, calls torch, and flattens the result again.
"""

from __future__ import annotations

import logging
import operator
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from planner.core.opaque import flat_shape, set_torch_evaluator, torch_call
from planner.core.ops import OpError
from planner.core.shapes import Attrs
from planner.core.torch_allowlist import (
    DTYPES,
    LAYOUTS,
    MEMORY_FORMATS,
    TORCH_CALLABLES,
    add_traced,
    add_user_allowed,
    is_allowed,
    refusal,
)

log = logging.getLogger(__name__)

_OPERATOR_FNS = frozenset(
    {"add", "sub", "mul", "truediv", "floordiv", "neg", "pow", "matmul", "getitem", "mod"}
)
_TORCH_NAMESPACES = ("torch.nn.functional.", "torch._C._nn.", "torch.special.", "torch.linalg.", "torch.fft.")


#: fx call targets the importer maps to op-table ops, by kind (``("method", name)`` for a Tensor method).
#: A mapping that does not apply (a broadcast Mul, an unknown GELU form) keeps the call as an Opaque step.
IMPORTER_TABLE: dict[Any, str] = {}


def _canon(kind: str, *targets: Any) -> None:
    for t in targets:
        IMPORTER_TABLE[t] = kind


_aten = torch.ops.aten
_canon("linear", F.linear, torch._C._nn.linear, _aten.linear.default)
_canon("matmul", operator.matmul, torch.matmul, torch.mm, _aten.mm.default, _aten.matmul.default,
       ("method", "matmul"), ("method", "mm"))
_canon("addmm", torch.addmm, _aten.addmm.default)
_canon("gelu", F.gelu, torch._C._nn.gelu, _aten.gelu.default)
_canon("relu", F.relu, torch.relu, _aten.relu.default, ("method", "relu"))
_canon("clamp", torch.clamp, torch.clip, F.hardtanh, F.relu6, _aten.clamp.default, _aten.clamp_min.default,
       _aten.clamp_max.default, _aten.hardtanh.default, _aten.relu6.default, ("method", "clamp"), ("method", "clip"),
       ("method", "clamp_min"), ("method", "clamp_max"), torch.clamp_min, torch.clamp_max)
_canon("avg_pool_window", F.avg_pool2d, F.avg_pool1d, torch.avg_pool1d, _aten.avg_pool2d.default,
       _aten.avg_pool1d.default)
_canon("permute", torch.permute, _aten.permute.default, ("method", "permute"))
_canon("leaky_relu", F.leaky_relu, _aten.leaky_relu.default)
_canon("hardswish", F.hardswish, _aten.hardswish.default)
_canon("hardsigmoid", F.hardsigmoid, _aten.hardsigmoid.default)
_canon("silu", F.silu, torch._C._nn.silu if hasattr(torch._C._nn, "silu") else F.silu, _aten.silu.default)
_canon("add", operator.add, operator.iadd, torch.add, _aten.add.Tensor, _aten.add.Scalar, ("method", "add"))
_canon("sub", operator.sub, operator.isub, torch.sub, _aten.sub.Tensor, _aten.sub.Scalar, ("method", "sub"))
_canon("mul", operator.mul, operator.imul, torch.mul, _aten.mul.Tensor, _aten.mul.Scalar, ("method", "mul"))
_canon("div", operator.truediv, operator.itruediv, torch.div, _aten.div.Tensor, _aten.div.Scalar, ("method", "div"))
_canon("neg", operator.neg, torch.neg, _aten.neg.default, ("method", "neg"))
_canon("rsub", _aten.rsub.Scalar, torch.rsub)
_canon("maximum", torch.maximum, _aten.maximum.default, ("method", "maximum"))
_canon("mean", torch.mean, _aten.mean.dim, ("method", "mean"))
_canon("sum", torch.sum, _aten.sum.dim_IntList, ("method", "sum"))
_canon("amax", torch.amax, _aten.amax.default, ("method", "amax"))
_canon("softmax", F.softmax, torch.softmax, _aten.softmax.int, _aten._softmax.default, ("method", "softmax"))
_canon("layer_norm", F.layer_norm, torch.layer_norm, _aten.layer_norm.default)
_canon("rms_norm", F.rms_norm, _aten.rms_norm.default)
_canon("minimum", torch.minimum, _aten.minimum.default, ("method", "minimum"))
_canon("pow", operator.pow, torch.pow, _aten.pow.Tensor_Scalar, ("method", "pow"))
_canon("sdpa", F.scaled_dot_product_attention, _aten.scaled_dot_product_attention.default)
_canon("dropout", F.dropout, _aten.dropout.default, torch.dropout)
_canon("same", ("method", "contiguous"), ("method", "clone"), ("method", "detach"), _aten.clone.default,
       _aten.alias.default, _aten.detach.default, torch.clone)
_canon("to", ("method", "to"), ("method", "float"), ("method", "half"), ("method", "bfloat16"), ("method", "type_as"),
       ("method", "type"), _aten.to.dtype, _aten._to_copy.default, _aten.type_as.default)
_canon("expand", ("method", "expand"), _aten.expand.default)
_canon("slice", _aten.slice.Tensor)
_canon("embedding", F.embedding, torch.embedding, _aten.embedding.default)
_canon("conv", torch.conv2d, torch.conv1d, _aten.conv2d.default, _aten.conv1d.default)
_canon("batch_norm", F.batch_norm, torch.batch_norm, _aten.batch_norm.default)
_canon("max_pool", F.max_pool2d, F.max_pool1d, torch.max_pool2d, torch.max_pool1d, _aten.max_pool2d.default,
       _aten.max_pool1d.default)
_canon("avg_pool", F.adaptive_avg_pool2d, torch.adaptive_avg_pool1d, _aten.adaptive_avg_pool2d.default,
       _aten._adaptive_avg_pool2d.default, _aten.adaptive_avg_pool1d.default)
_canon("cat", torch.cat, torch.concat, torch.concatenate, _aten.cat.default)
_canon("view", ("method", "view"), ("method", "reshape"), ("method", "flatten"), ("method", "unsqueeze"),
       ("method", "squeeze"), ("method", "view_as"), ("method", "reshape_as"), torch.reshape, torch.flatten,
       torch.unsqueeze, torch.squeeze, _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default,
       _aten.unsqueeze.default, _aten.squeeze.dim, _aten.flatten.using_ints)

_KEPT_METHODS = (
    "transpose", "permute", "t", "expand", "expand_as", "repeat", "split", "chunk", "unbind", "narrow", "select",
    "unflatten", "movedim", "swapaxes", "flip", "roll", "index_select", "gather", "where", "masked_fill",
    "softmax", "log_softmax", "mean", "sum", "var", "std", "cumsum", "max", "min", "amax", "amin",
    "pow", "square", "rsqrt", "sqrt", "reciprocal", "exp", "log", "tanh", "sigmoid", "erf", "cos", "sin", "abs",
    "clamp", "tril", "triu", "matmul", "bmm", "mm", "half", "bfloat16",
    "long",  # the importer's conversion of integer indices bound as fp32 (core.inputs.INDEX_STEP)
)
#: torch calls the importer keeps as Opaque steps (the ops of the models it was tried on); with
#: IMPORTER_TABLE this is everything the importer can emit, so it is the allowlist
#: (:data:`planner.core.torch_allowlist.TORCH_CALLABLES` must equal :func:`derived_allowlist`).
KEPT_OPAQUE: tuple[Any, ...] = (
    F.layer_norm, F.rms_norm, F.group_norm, F.softmax, F.log_softmax, F.scaled_dot_product_attention,
    F.embedding, F.pad, F.normalize, F.conv1d, F.conv2d, F.sigmoid, F.tanh, F.mish, F.softplus, F.elu,
    F.leaky_relu, F.hardswish, F.hardsigmoid, F.relu6, F.glu,
    torch.softmax, torch.log_softmax, torch.matmul, torch.bmm, torch.mm, torch.addmm, torch.baddbmm, torch.einsum,
    torch.transpose, torch.permute, torch.t, torch.cat, torch.concat, torch.stack, torch.split, torch.chunk,
    torch.unbind, torch.narrow, torch.select, torch.index_select, torch.gather, torch.where, torch.masked_fill,
    torch.movedim, torch.swapaxes, torch.flip, torch.roll, torch.tanh, torch.exp, torch.log, torch.sigmoid,
    torch.sqrt, torch.rsqrt, torch.pow, torch.square, torch.reciprocal, torch.abs, torch.erf, torch.cos, torch.sin,
    torch.mean, torch.sum, torch.var, torch.std, torch.cumsum, torch.amax, torch.amin, torch.max, torch.min,
    torch.maximum, torch.minimum, torch.clamp, torch.tril, torch.triu, torch.outer, torch.layer_norm,
    torch.embedding, torch.zeros_like, torch.ones_like, torch.full_like,
    operator.getitem, operator.matmul, operator.pow, operator.floordiv, operator.mod,
    _aten.softmax.int, _aten._softmax.default, _aten.log_softmax.int, _aten._log_softmax.default,
    _aten.layer_norm.default, _aten.native_layer_norm.default, _aten.rms_norm.default,
    _aten.scaled_dot_product_attention.default, _aten.matmul.default, _aten.mm.default, _aten.bmm.default,
    _aten.addmm.default, _aten.baddbmm.default, _aten.t.default, _aten.transpose.int, _aten.permute.default,
    _aten.expand.default, _aten.slice.Tensor, _aten.select.int, _aten.cat.default, _aten.stack.default,
    _aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default, _aten.unbind.int,
    _aten.unflatten.int, _aten.squeeze.default, _aten.squeeze.dims, _aten.repeat.default, _aten.embedding.default,
    _aten.mean.dim, _aten.mean.default, _aten.sum.dim_IntList, _aten.sum.default, _aten.var.correction,
    _aten.var_mean.correction, _aten.pow.Tensor_Scalar, _aten.pow.Tensor_Tensor, _aten.rsqrt.default,
    _aten.sqrt.default, _aten.reciprocal.default, _aten.square.default, _aten.tanh.default, _aten.exp.default,
    _aten.log.default, _aten.sigmoid.default, _aten.erf.default, _aten.cos.default, _aten.sin.default,
    _aten.abs.default, _aten.where.self, _aten.masked_fill.Scalar, _aten.masked_fill.Tensor, _aten.amax.default,
    _aten.max.dim, _aten.minimum.default, _aten.maximum.default, _aten.clamp.default, _aten.tril.default,
    _aten.triu.default, _aten.index_select.default, _aten.gather.default, _aten.div.Tensor_mode,
    _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default,
    *(("method", m) for m in _KEPT_METHODS),
)


# ---------------------------------------------------------------- names


def torch_fn_name(target: Any) -> str | None:
    """The stable dotted name of an fx call target, or None when it has none."""
    if isinstance(target, str):
        return f"torch.Tensor.{target}"
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    mod = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    if name is None:
        return None
    if mod == "_operator" and name in _OPERATOR_FNS:
        return f"torch.operator.{name}"
    if getattr(torch._C._VariableFunctions, name, None) is target or getattr(torch, name, None) is target:
        return f"torch.{name}"
    for ns in _TORCH_NAMESPACES:
        owner = _lookup(ns[:-1])
        if owner is not None and getattr(owner, name, None) is target:
            return ns + name
    return None


def _lookup(dotted: str) -> Any:
    """The object at a dotted ``torch.`` path through modules only (``torch.nn.functional.torch`` is not
    ``torch.nn.functional``'s own submodule, so it stops there); None where the path leaves torch."""
    parts = dotted.split(".")
    if parts[0] != "torch" or not all(p.isidentifier() for p in parts):
        return None
    obj: Any = torch
    for i, part in enumerate(parts[1:], start=1):
        if not isinstance(obj, types.ModuleType) or obj.__name__ != ".".join(parts[:i]):
            return None
        obj = getattr(obj, part, None)
    return obj


def resolve_canonical(name: str) -> Callable[..., Any]:
    """The torch callable whose canonical name (:func:`torch_fn_name`) is exactly ``name``.

    Used for the allowlist's own names and for names a user allows explicitly, never
    for a name read from a file that is not already allowed.
    """
    fn: Any = None
    if name.startswith("torch.Tensor."):
        short = name.removeprefix("torch.Tensor.")
        fn = getattr(torch.Tensor, short, None) if short.isidentifier() else None
        target: Any = short
    elif name.startswith("torch.operator."):
        short = name.removeprefix("torch.operator.")
        fn = target = getattr(operator, short) if short in _OPERATOR_FNS else None
    elif name.startswith("torch.ops."):
        parts = name.split(".")
        if len(parts) == 5 and all(p.isidentifier() for p in parts):
            packet = getattr(getattr(torch.ops, parts[2], None), parts[3], None)
            fn = target = getattr(packet, parts[4], None) if isinstance(packet, torch._ops.OpOverloadPacket) else None
    else:
        fn = target = _lookup(name)
    if not callable(fn) or isinstance(fn, (type, types.ModuleType)) or torch_fn_name(target) != name:
        raise OpError(f"{name!r} is not the canonical name of a torch function")
    return fn


def derived_allowlist() -> frozenset[str]:
    """The names of everything the importer can emit (IMPORTER_TABLE and KEPT_OPAQUE)."""
    names = set()
    for target in (*IMPORTER_TABLE, *KEPT_OPAQUE):
        name = torch_fn_name(target[1] if isinstance(target, tuple) else target)
        if name is not None and not name.startswith(_INPLACE_PREFIXES):  # in-place ops are emitted out of place
            names.add(name)
    return frozenset(names)


_INPLACE_PREFIXES = ("torch.operator.i",)
_CALLABLES: dict[str, Callable[..., Any]] = {}
for _name in sorted(TORCH_CALLABLES):
    try:
        _CALLABLES[_name] = resolve_canonical(_name)
    except OpError:  # another torch release may lack an op; the name stays refused
        log.debug("allowlisted torch callable %s does not exist in torch %s", _name, torch.__version__)

_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in DTYPES}
_MEMORY_FORMATS: dict[str, torch.memory_format] = {n: getattr(torch, n) for n in MEMORY_FORMATS}
_LAYOUTS: dict[str, torch.layout] = {n: getattr(torch, n) for n in LAYOUTS}


def resolve_torch_fn(name: str) -> Callable[..., Any]:
    """The torch callable behind an allowed name; anything else is refused without a lookup."""
    fn = _CALLABLES.get(name) if is_allowed(name) else None
    if fn is None:
        raise refusal(name)
    return fn


def allow_torch_ops(names: Iterable[str]) -> list[str]:
    """Allow more torch callables by exact canonical name (``--allow-torch-op``; docs/security.md)."""
    added = []
    for name in names:
        if not isinstance(name, str):
            raise OpError(f"allow_torch_ops: {name!r} is not a name")
        try:
            fn = resolve_canonical(name)
        except OpError as exc:
            raise OpError(f"cannot allow {name!r}: {exc}") from None
        _CALLABLES[name] = fn
        added.append(name)
    add_user_allowed(added)
    return added


def trust_traced(target: Any) -> str | None:
    """The name of a call target met while tracing a trusted module in this process, now callable here.

    Names outside the allowlist stay usable in this process only (see planner.core.torch_allowlist)."""
    name = torch_fn_name(target)
    if name is None:
        return None
    if name not in _CALLABLES:
        _CALLABLES[name] = getattr(torch.Tensor, target) if isinstance(target, str) else target
        add_traced(name)
    return name


# ---------------------------------------------------------------- call encoding


def encode_arg(value: Any, tensor_ref: Callable[[Any], dict[str, int] | None]) -> Any:
    """JSON form of one call argument; ``tensor_ref`` encodes tensors (``{"$in": k}`` or ``{"$step": j}``)."""
    ref = tensor_ref(value)
    if ref is not None:
        return ref
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode_arg(v, tensor_ref) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [encode_arg(v, tensor_ref) for v in value]}
    if isinstance(value, dict):
        return {"$dict": {str(k2): encode_arg(v, tensor_ref) for k2, v in value.items()}}
    if isinstance(value, slice):
        return {"$slice": [encode_arg(v, tensor_ref) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:
        return {"$ellipsis": 0}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": value.type}
    if isinstance(value, torch.memory_format):
        return {"$memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Tensor) and value.numel() <= 65536:
        t = value.detach().cpu()
        return {"$tensor": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.flatten().tolist()}}
    raise TypeError(f"cannot record an argument of type {type(value).__name__}")


def _decode(d: Any, inputs: Sequence[torch.Tensor], steps: Sequence[Any]) -> Any:
    if isinstance(d, list):
        return [_decode(v, inputs, steps) for v in d]
    if not isinstance(d, dict):
        return d
    (tag, v), = d.items()
    if tag == "$in":
        return inputs[v]
    if tag == "$step":
        return steps[v]
    if tag == "$tuple":
        return tuple(_decode(x, inputs, steps) for x in v)
    if tag == "$dict":
        return {k: _decode(x, inputs, steps) for k, x in v.items()}
    if tag == "$slice":
        return slice(*(_decode(x, inputs, steps) for x in v))
    if tag == "$ellipsis":
        return Ellipsis
    if tag == "$dtype":
        return _DTYPES[v]
    if tag == "$device":
        return torch.device("cpu")  # torch-backed Opaque kernels run on the host
    if tag == "$memory_format":
        return _MEMORY_FORMATS[v]
    if tag == "$layout":
        return _LAYOUTS[v]
    if tag == "$tensor":
        return torch.tensor(v["data"], dtype=_DTYPES[v["dtype"]]).reshape(v["shape"])
    raise OpError(f"unknown tag {tag!r} in a torch Opaque call")


# ---------------------------------------------------------------- the implementation


def _evaluate(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    """Run the node's torch calls in order on the input arrays; the last call's result is the output."""
    call = torch_call(attrs)
    ts = [torch.from_numpy(np.ascontiguousarray(x)).reshape(s) for x, s in zip(xs, call["in"], strict=True)]
    out = _run_steps(str(attrs["impl"]), _prepared_steps(call), ts)
    work = xs[0].dtype if xs else np.dtype(np.float32)
    return out.detach().to(torch.float64 if work == np.float64 else torch.float32).reshape(flat_shape(out.shape)).numpy()


def _prepare(attrs: Attrs) -> Callable[[Sequence[np.ndarray], np.ndarray], None]:
    """A writer for a node run many times: the call is checked, its callables resolved and its
    constant arguments decoded once; each run wraps the arrays as tensors without copying them."""
    call = torch_call(attrs)
    impl = str(attrs["impl"])
    steps = _prepared_steps(call)
    in_shapes = [tuple(s) for s in call["in"]]

    def write(xs: Sequence[np.ndarray], out: np.ndarray) -> None:
        ts = [numpy_view(x).reshape(s) for x, s in zip(xs, in_shapes, strict=True)]
        value = _run_steps(impl, steps, ts)
        target = torch.from_numpy(out)
        if value.numel() != target.numel():
            raise OpError(f"Opaque[{impl}] computed shape {list(value.shape)}, expected {list(out.shape)}")
        target.copy_(value.reshape(target.shape))

    return write


def numpy_view(x: np.ndarray) -> torch.Tensor:
    """``x`` as a tensor without a copy; a read-only array (a bound parameter) is only ever read by the
    recorded calls, which are out of place (the allowlist has no in-place op), so torch's warning is moot."""
    if x.flags.writeable:
        return torch.from_numpy(x)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(x)


Decoded = Callable[[Sequence[torch.Tensor], Sequence[Any]], Any]


def _prepared_steps(call: dict[str, Any]) -> list[tuple[str, Callable[..., Any], Decoded, Decoded, int]]:
    return [(s["impl"], resolve_torch_fn(s["impl"]), _decoder(s["args"]), _decoder(s["kwargs"]), s.get("item", -1))
            for s in call["steps"]]


def _decoder(d: Any) -> Decoded:
    """``decode(inputs, steps)``: the argument ``d`` describes; every part that holds no tensor reference is
    decoded now (a constant tensor beside a step's result was built from its JSON list on every call: 280 µs of
    a padding mask's 356 each call)."""
    if not _refers(d):
        value = _decode(d, (), ())
        return lambda ts, results: value
    if isinstance(d, list):
        items = [_decoder(v) for v in d]
        return lambda ts, results: [item(ts, results) for item in items]
    (tag, v), = d.items()
    if tag == "$in":
        return lambda ts, results: ts[v]
    if tag == "$step":
        return lambda ts, results: results[v]
    if tag == "$dict":
        fields = {k: _decoder(x) for k, x in v.items()}
        return lambda ts, results: {k: f(ts, results) for k, f in fields.items()}
    parts = [_decoder(x) for x in v]
    if tag == "$tuple":
        return lambda ts, results: tuple(part(ts, results) for part in parts)
    if tag == "$slice":
        return lambda ts, results: slice(*(part(ts, results) for part in parts))
    raise OpError(f"unknown tag {tag!r} in a torch Opaque call")


def _refers(d: Any) -> bool:
    if isinstance(d, list):
        return any(_refers(v) for v in d)
    if not isinstance(d, dict):
        return False
    (tag, v), = d.items()
    return tag in ("$in", "$step") or (tag != "$tensor" and _refers(v if tag != "$dict" else list(v.values())))


def _run_steps(impl: str, steps: Sequence[tuple[str, Callable[..., Any], Decoded, Decoded, int]],
               ts: Sequence[torch.Tensor]) -> torch.Tensor:
    results: list[Any] = []
    with torch.no_grad():
        for j, (name, fn, args, kwargs, item) in enumerate(steps):
            try:
                pos, kw = args(ts, results), kwargs(ts, results)
                if name.startswith(PYTHON_OPERATOR):
                    _bounded_operator(fn, pos)
                out = fn(*pos, **kw)
                if item >= 0:
                    out = out[item]
            except OpError as exc:
                raise OpError(f"Opaque[{impl}] step {j} ({name}): {exc}") from None
            except Exception as exc:  # the recorded call does not fit: any exception is the step's, by name
                raise OpError(f"Opaque[{impl}] step {j} ({name}) failed: {_one_line(exc)}") from None
            if isinstance(out, torch.Tensor) and out.device.type != "cpu":
                raise OpError(f"Opaque[{impl}] step {j} ({name}) gave a tensor on {out.device}; steps run on the host")
            results.append(out)
    out = results[-1]
    if not isinstance(out, torch.Tensor):
        raise OpError(f"Opaque[{impl}] returned {type(out).__name__}, not a tensor")
    return out


#: the prefix of the Python operators a step may call (on tensors, or on the Python numbers of a shape)
PYTHON_OPERATOR = "torch.operator."
#: the largest exponent, and the bits of the largest product, of a Python-number operator in a step
MAX_EXPONENT = 64
MAX_PRODUCT_BITS = 128


def _bounded_operator(fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """Refuse a Python operator on plain Python values whose result could take unbounded time or memory:
    sequence repetition, a huge power or product (``10 ** 10**9``, ``[0] * 4e9``). Tensors are bounded by
    their shapes, which the graph limits already bound."""
    plain = [a for a in args if not isinstance(a, torch.Tensor)]
    if fn is operator.mul and any(isinstance(a, (list, tuple, str, bytes)) for a in plain):
        raise OpError("repeating a Python sequence is refused (its size would be unbounded)")
    if len(plain) != 2 or not all(isinstance(a, (int, float)) for a in plain):
        return
    a, b = plain
    if fn is operator.pow and (abs(b) > MAX_EXPONENT or abs(a) >= 2**MAX_EXPONENT):
        raise OpError(f"the power {str(a)[:20]} ** {str(b)[:20]} is refused (exponent at most {MAX_EXPONENT})")
    if fn is operator.mul and isinstance(a, int) and isinstance(b, int) and (
            abs(a).bit_length() + abs(b).bit_length() > MAX_PRODUCT_BITS):
        raise OpError(f"a product of {MAX_PRODUCT_BITS} bits or more is refused")


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


set_torch_evaluator(_evaluate, _prepare)

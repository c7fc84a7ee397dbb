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

import json
import logging
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from planner.opaque import OpaqueImpl, register_opaque, registered_opaque
from planner.ops import Attrs, OpError, Shape

log = logging.getLogger(__name__)

#: torch.Tensor methods that never become an Opaque implementation
_DENIED_METHODS = frozenset(
    {
        "backward", "register_hook", "numpy", "tolist", "item", "storage", "untyped_storage",
        "share_memory_", "pin_memory", "data_ptr", "cuda", "cpu", "to_sparse", "record_stream",
        "set_", "resize_", "copy_", "apply_", "map_", "map2_", "new_tensor",
    }
)
_OPERATOR_FNS = frozenset(
    {"add", "sub", "mul", "truediv", "floordiv", "neg", "pow", "matmul", "getitem", "iadd", "imul", "isub", "itruediv", "mod"}
)
_TORCH_NAMESPACES = ("torch.nn.functional.", "torch._C._nn.", "torch.special.", "torch.linalg.", "torch.fft.")


def flat_shape(shape: Sequence[int]) -> Shape:
    """The IR shape of a torch tensor: leading dims folded into one row dim (M = prod).

    A 0-d tensor becomes ``(1,)``; 1-D and 2-D shapes are kept.  The IR's
    MatMul is 2-D, so a Linear on a ``(B, S, D)`` input is a ``(B*S, D)`` GEMM.
    """
    s = tuple(int(d) for d in shape)
    if not s:
        return (1,)
    if len(s) <= 2:
        return s
    return (math.prod(s[:-1]), s[-1])


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
    obj: Any = None
    for i, part in enumerate(dotted.split(".")):
        obj = torch if i == 0 and part == "torch" else getattr(obj, part, None) if obj is not None else None
        if obj is None:
            return None
    return obj


def resolve_torch_fn(name: str) -> Callable[..., Any]:
    """The torch callable behind an allowed Opaque name; anything else is an OpError."""
    fn: Any = None
    if name.startswith("torch.operator."):
        short = name.removeprefix("torch.operator.")
        fn = getattr(operator, short) if short in _OPERATOR_FNS else None
    elif name.startswith("torch.Tensor."):
        short = name.removeprefix("torch.Tensor.")
        if not short.startswith("_") or short in ("__getitem__",):
            fn = None if short in _DENIED_METHODS else getattr(torch.Tensor, short, None)
    elif name.startswith("torch.ops.aten."):
        parts = name.split(".")
        if len(parts) == 5:
            packet = getattr(torch.ops.aten, parts[3], None)
            fn = getattr(packet, parts[4], None) if packet is not None else None
    elif name.startswith(_TORCH_NAMESPACES):
        fn = _lookup(name)
    elif name.count(".") == 1:
        short = name.removeprefix("torch.")
        fn = getattr(torch._C._VariableFunctions, short, None)
        if fn is None and short in torch.functional.__all__:
            fn = getattr(torch.functional, short)
    if not callable(fn):
        raise OpError(
            f"Opaque implementation {name!r} is not an allowed torch function "
            "(see planner.torch_ops.resolve_torch_fn for the namespaces)"
        )
    return fn


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
        return getattr(torch, v)
    if tag == "$device":
        return torch.device("cpu")  # torch-backed Opaque kernels run on the host
    if tag == "$memory_format":
        return getattr(torch, v)
    if tag == "$layout":
        return getattr(torch, v)
    if tag == "$tensor":
        return torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
    raise OpError(f"unknown tag {tag!r} in a torch Opaque call")


def _call_of(attrs: Attrs) -> dict[str, Any]:
    try:
        call = json.loads(str(attrs["call"]))
    except (KeyError, json.JSONDecodeError) as exc:
        raise OpError(f"Opaque[{attrs.get('impl')}]: missing or malformed 'call' attribute ({exc})") from None
    return call


# ---------------------------------------------------------------- the implementation


def _shape(shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    call = _call_of(attrs)
    recorded = [flat_shape(s) for s in call["in"]]
    if len(recorded) != len(shapes):
        raise OpError(f"Opaque[{attrs['impl']}]: expects {len(recorded)} tensor input(s), got {len(shapes)}")
    for i, (want, got) in enumerate(zip(recorded, shapes, strict=False)):
        if tuple(got) != want:
            raise OpError(f"Opaque[{attrs['impl']}]: input {i} has shape {list(got)}, recorded {list(want)}")
    return flat_shape(call["out"])


def _evaluate(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    """Run the node's torch calls in order on the input arrays; the last call's result is the output."""
    call = _call_of(attrs)
    ts = [torch.from_numpy(np.ascontiguousarray(x)).reshape(s) for x, s in zip(xs, call["in"], strict=True)]
    results: list[Any] = []
    with torch.no_grad():
        for step in call["steps"]:
            fn = resolve_torch_fn(step["impl"])
            out = fn(*_decode(step["args"], ts, results), **_decode(step["kwargs"], ts, results))
            if step.get("item", -1) >= 0:
                out = out[step["item"]]
            results.append(out)
    out = results[-1]
    if not isinstance(out, torch.Tensor):
        raise OpError(f"Opaque[{attrs['impl']}] returned {type(out).__name__}, not a tensor")
    work = xs[0].dtype if xs else np.dtype(np.float32)
    return out.detach().to(torch.float64 if work == np.float64 else torch.float32).reshape(flat_shape(out.shape)).numpy()


def step_flops(step: dict[str, Any]) -> float:
    """A rough FLOP count: GEMM-like calls by their contraction, the rest 4 per output element."""
    name = str(step["impl"])
    shapes = [tuple(s) for s in step.get("shapes", [])]
    elems = math.prod(step["out"]) if step["out"] else 1
    if "scaled_dot_product_attention" in name and len(shapes) >= 3:
        q, k = shapes[0], shapes[1]
        return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]
    if any(w in name for w in ("matmul", "bmm", "linear", ".mm", "einsum")) and shapes and shapes[0]:
        return 2.0 * elems * shapes[0][-1]
    return 4.0 * elems


def _flops(out: Shape, ins: Sequence[Shape], attrs: Attrs) -> float:
    return sum(step_flops(step) for step in _call_of(attrs)["steps"])


def ensure_registered(name: str) -> str:
    """Register the torch-backed Opaque implementation ``name`` (idempotent)."""
    if name not in registered_opaque():
        resolve_torch_fn(name)
        register_opaque(OpaqueImpl(name, None, _shape, _evaluate, _flops, f"torch-backed: {name}"))
    return name


def resolve_opaque(name: str) -> OpaqueImpl | None:
    """Hook for :func:`planner.opaque.opaque_impl`: registers an allowed torch name on first use."""
    try:
        ensure_registered(name)
    except OpError:
        return None
    from planner.opaque import opaque_impl

    return opaque_impl(name)

"""The Opaque op kind and the registry of its implementations.

An ``Opaque`` node names one of these by its ``impl`` attribute.  A graph never
carries code: a saved graph or plan names the implementation, and loading it
looks the name up here.  Unknown names are an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.core.kinds import OpKind
from planner.core.ops import AttrSpec, OpDef, OpError, register_op
from planner.core.shapes import Attrs, Shape
from planner.core.torch_allowlist import check_torch_call, is_allowed, refusal

ShapeFn = Callable[[Sequence[Shape], Attrs], Shape]
EvalFn = Callable[[Sequence[np.ndarray], Attrs], np.ndarray]
FlopsFn = Callable[[Shape, Sequence[Shape], Attrs], float]
#: writes a node's value into an output array: ``write(inputs, out)``
WriteFn = Callable[[Sequence[np.ndarray], np.ndarray], None]


@dataclass(frozen=True)
class OpaqueImpl:
    """A registered implementation: shape rule, numpy semantics, FLOP count."""

    name: str
    arity: int | None
    shape_fn: ShapeFn
    eval_fn: EvalFn
    flops_fn: FlopsFn
    doc: str = ""

    def shape(self, shapes: Sequence[Shape], attrs: Attrs) -> Shape:
        if self.arity is not None and len(shapes) != self.arity:
            raise OpError(f"Opaque[{self.name}]: expects {self.arity} input(s), got {len(shapes)}")
        return self.shape_fn(shapes, attrs)

    def evaluate(self, xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
        return self.eval_fn(xs, attrs)

    def flops(self, out: Shape, shapes: Sequence[Shape], attrs: Attrs) -> float:
        return float(self.flops_fn(out, shapes, attrs))


_REGISTRY: dict[str, OpaqueImpl] = {}


def register_opaque(impl: OpaqueImpl, *, replace: bool = False) -> OpaqueImpl:
    """Add an implementation to the allowlist."""
    if impl.name in _REGISTRY and not replace:
        raise OpError(f"Opaque implementation {impl.name!r} is already registered")
    _REGISTRY[impl.name] = impl
    return impl


def opaque_impl(name: str) -> OpaqueImpl:
    """The implementation ``name``; a torch callable the allowlist admits is registered on first use
    (its shape and FLOPs come from the node's call description; executing it needs the torch layer)."""
    if name not in _REGISTRY and name.startswith("torch.") and is_allowed(name):
        register_opaque(OpaqueImpl(name, None, _torch_shape, _torch_evaluate, _torch_flops, f"torch-backed: {name}"))
    try:
        return _REGISTRY[name]
    except KeyError:
        if name.startswith("torch."):
            raise refusal(name) from None
        raise OpError(
            f"Opaque implementation {name!r} is not registered; registered: "
            f"{', '.join(sorted(_REGISTRY))}"
        ) from None


def registered_opaque() -> list[str]:
    return sorted(_REGISTRY)


# ---------------------------------------------------------------- torch-backed implementations
# A torch-backed Opaque node names torch calls by exact name and records their shapes in its
# ``call`` attribute (JSON; planner.core.torch_allowlist checks it). Shapes and FLOPs come from
# that record, so loading and costing need no torch; executing needs the evaluator that
# planner.torch.ops installs when it is imported.

_torch_evaluator: list[EvalFn] = []
_torch_writer: list[Callable[[Attrs], WriteFn]] = []


def set_torch_evaluator(fn: EvalFn, prepare: Callable[[Attrs], WriteFn]) -> None:
    """Install what executes torch-backed Opaque nodes (the torch layer does, on import): ``fn``
    evaluates a node once; ``prepare(attrs)`` decodes its call once and returns a :data:`WriteFn`."""
    _torch_evaluator[:] = [fn]
    _torch_writer[:] = [prepare]


def opaque_writer(attrs: Attrs) -> WriteFn:
    """A function writing an Opaque node's value into an array of its output shape, for a backend that
    runs the node many times: a torch-backed node's call is checked and decoded here, once, and runs
    on views of the given arrays; other implementations evaluate, then copy."""
    name = str(attrs.get("impl"))
    impl = opaque_impl(name)
    if name.startswith("torch."):
        if not _torch_writer:
            _torch_evaluate([], attrs)  # raises the "install torch" error
        return _torch_writer[0](attrs)

    def write(xs: Sequence[np.ndarray], out: np.ndarray) -> None:
        value = impl.evaluate(xs, attrs)
        if value.shape != out.shape:
            raise OpError(f"Opaque[{name}] computed shape {list(value.shape)}, expected {list(out.shape)}")
        out[...] = value

    return write


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


def torch_call(attrs: Attrs) -> dict[str, Any]:
    """A torch-backed node's call description, checked (names, tags, sizes) every time: the check
    depends on whether a file is being loaded, so its result is never cached."""
    return check_torch_call(str(attrs.get("impl")), attrs.get("call"))


def _torch_shape(shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    call = torch_call(attrs)
    recorded = [flat_shape(s) for s in call["in"]]
    if len(recorded) != len(shapes):
        raise OpError(f"Opaque[{attrs['impl']}]: expects {len(recorded)} tensor input(s), got {len(shapes)}")
    for i, (want, got) in enumerate(zip(recorded, shapes, strict=False)):
        if flat_shape(got) != want:  # a head-major (batch * heads, seq, d) input is the same rows
            raise OpError(f"Opaque[{attrs['impl']}]: input {i} has shape {list(got)}, recorded {list(want)}")
    return flat_shape(call["out"])


def _torch_flops(out: Shape, ins: Sequence[Shape], attrs: Attrs) -> float:
    return sum(step_flops(step) for step in torch_call(attrs)["steps"])


def _torch_evaluate(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    if not _torch_evaluator:
        raise OpError(f"Opaque[{attrs.get('impl')}] is executed by torch, whose evaluator is not loaded: call "
                      "planner.torch.need_evaluator(graph) first (the planner's faces do; torch must be installed)")
    return _torch_evaluator[0](xs, attrs)


# ---------------------------------------------------------------- built-ins


def _first_shape(shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    return shapes[0]


def _number(attrs: Attrs, name: str, default: float, what: str) -> float:
    """A finite float attribute of a built-in implementation; an OpError naming it otherwise."""
    v = attrs.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise OpError(f"{what}: attribute {name!r} must be a finite number, got {str(v)[:40]!r}")
    return float(v)


def _count(attrs: Attrs, name: str, default: int, what: str) -> int:
    """A positive integer attribute of a built-in implementation."""
    v = attrs.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) or v < 1:
        raise OpError(f"{what}: attribute {name!r} must be a positive integer, got {str(v)[:40]!r}")
    return int(v)


def _norm_shape(shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    if not 1 <= len(shapes) <= 3:
        raise OpError(f"norm: expects x[, weight[, bias]], got {len(shapes)} input(s)")
    _number(attrs, "eps", 1e-5, "norm")
    x = shapes[0]
    for p in shapes[1:]:
        if p != (x[-1],):
            raise OpError(f"norm parameter shape {list(p)} does not match last dim of {list(x)}")
    return x


def _layer_norm(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    x = xs[0]
    eps = x.dtype.type(_number(attrs, "eps", 1e-5, "layer_norm"))
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if len(xs) > 1:
        y = y * xs[1]
    if len(xs) > 2:
        y = y + xs[2]
    return y


def _rms_norm(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    x = xs[0]
    eps = x.dtype.type(_number(attrs, "eps", 1e-6, "rms_norm"))
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y * xs[1] if len(xs) > 1 else y


def _softmax(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    x = xs[0]
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _attention_shape(shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    q, k, v = shapes
    heads = _count(attrs, "heads", 1, "attention")
    causal = attrs.get("causal", False)
    if not isinstance(causal, (bool, int)) or causal not in (0, 1):
        raise OpError(f"attention: attribute 'causal' must be true or false (or 1, 0), got {str(causal)[:40]!r}")
    if len(q) != 2 or k != v or q[1] != k[1]:
        raise OpError(f"attention expects q (S,D), k and v (T,D); got {q}, {k}, {v}")
    if q[1] % heads:
        raise OpError(f"attention: model dim {q[1]} is not divisible by heads={heads}")
    return q


def _attention(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    q, k, v = xs
    heads = _count(attrs, "heads", 1, "attention")
    causal = bool(attrs.get("causal", False))
    s, d = q.shape
    t = k.shape[0]
    dh = d // heads
    qh = q.reshape(s, heads, dh).transpose(1, 0, 2)
    kh = k.reshape(t, heads, dh).transpose(1, 0, 2)
    vh = v.reshape(t, heads, dh).transpose(1, 0, 2)
    scores = qh @ kh.transpose(0, 2, 1) * q.dtype.type(1.0 / math.sqrt(dh))
    if causal:
        mask = np.triu(np.ones((s, t), dtype=bool), k=1 + t - s)
        scores = np.where(mask, q.dtype.type(-np.inf), scores)
    p = _softmax([scores], {})
    return (p @ vh).transpose(1, 0, 2).reshape(s, d)


def _elems(shape: Shape) -> int:
    return math.prod(shape)


for _impl in [
    OpaqueImpl(
        "layer_norm",
        None,
        _norm_shape,
        _layer_norm,
        lambda out, ins, a: 8 * _elems(out),
        "LayerNorm over the last dim; inputs x[, weight[, bias]]; attr eps.",
    ),
    OpaqueImpl(
        "rms_norm",
        None,
        _norm_shape,
        _rms_norm,
        lambda out, ins, a: 4 * _elems(out),
        "RMSNorm over the last dim; inputs x[, weight]; attr eps.",
    ),
    OpaqueImpl(
        "softmax",
        1,
        _first_shape,
        _softmax,
        lambda out, ins, a: 5 * _elems(out),
        "Softmax over the last dim.",
    ),
    OpaqueImpl(
        "attention",
        3,
        _attention_shape,
        _attention,
        lambda out, ins, a: 4.0 * ins[0][0] * ins[1][0] * ins[0][1],
        "Scaled dot-product attention on (S,D) q and (T,D) k, v; attrs heads, causal.",
    ),
]:
    register_opaque(_impl)


# ---------------------------------------------------------------- the Opaque op kind


def _check_opaque_attrs(attrs: dict[str, Any]) -> None:
    if str(attrs["impl"]).startswith("torch."):
        check_torch_call(str(attrs["impl"]), attrs.get("call"))  # names only; nothing is looked up


register_op(
    OpDef(
        name="Opaque",
        kind=OpKind.OPAQUE,
        arity=None,
        attrs=(AttrSpec("impl", "String"),),
        shape_rule=lambda op, shapes, attrs: opaque_impl(str(attrs["impl"])).shape(shapes, attrs),
        numpy_fn=lambda xs, attrs: opaque_impl(str(attrs["impl"])).evaluate(xs, attrs),
        flops_rule=lambda out, ins, attrs: opaque_impl(str(attrs["impl"])).flops(out, ins, attrs),
        attr_check=_check_opaque_attrs,
        regs=lambda attrs: 32,
        doc="A registered implementation the rules do not know; always its own kernel.",
    )
)


def torch_backed(node: Any) -> bool:
    """Is this node (a graph node or a kernel body expression) an Opaque one that runs torch calls?"""
    return node.op == "Opaque" and str(node.attr_dict.get("impl", "")).startswith("torch.")


def has_torch_steps(graph_ops: Sequence[Any]) -> bool:
    """Does one of these nodes (graph nodes or kernel body expressions) run torch calls?"""
    return any(map(torch_backed, graph_ops))


def torch_evaluator_loaded() -> bool:
    return bool(_torch_evaluator)

"""The allowlist of registered Opaque implementations.

An ``Opaque`` node names one of these by its ``impl`` attribute.  A graph never
carries code: a saved graph or plan names the implementation, and loading it
looks the name up here.  Unknown names are an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from planner.ops import Attrs, OpError, Shape

ShapeFn = Callable[[Sequence[Shape], Attrs], Shape]
EvalFn = Callable[[Sequence[np.ndarray], Attrs], np.ndarray]
FlopsFn = Callable[[Shape, Sequence[Shape], Attrs], float]


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
    if name not in _REGISTRY and name.startswith("torch."):
        # torch-backed impls are registered on first use, so a saved plan loads in a fresh process
        try:
            from planner.torch_ops import resolve_opaque
        except ImportError:  # torch is not installed: the name stays unknown
            pass
        else:
            resolve_opaque(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise OpError(
            f"Opaque implementation {name!r} is not registered; registered: "
            f"{', '.join(sorted(_REGISTRY))}"
        ) from None


def registered_opaque() -> list[str]:
    return sorted(_REGISTRY)


# ---------------------------------------------------------------- built-ins


def _first_shape(shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    return shapes[0]


def _norm_shape(shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    x = shapes[0]
    for p in shapes[1:]:
        if p != (x[-1],):
            raise OpError(f"norm parameter shape {list(p)} does not match last dim of {list(x)}")
    return x


def _layer_norm(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    x = xs[0]
    eps = x.dtype.type(attrs.get("eps", 1e-5))
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
    eps = x.dtype.type(attrs.get("eps", 1e-6))
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y * xs[1] if len(xs) > 1 else y


def _softmax(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    x = xs[0]
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _attention_shape(shapes: Sequence[Shape], attrs: Attrs) -> Shape:
    q, k, v = shapes
    heads = int(attrs.get("heads", 1))
    if len(q) != 2 or k != v or q[1] != k[1]:
        raise OpError(f"attention expects q (S,D), k and v (T,D); got {q}, {k}, {v}")
    if q[1] % heads:
        raise OpError(f"attention: model dim {q[1]} is not divisible by heads={heads}")
    return q


def _attention(xs: Sequence[np.ndarray], attrs: Attrs) -> np.ndarray:
    q, k, v = xs
    heads = int(attrs.get("heads", 1))
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

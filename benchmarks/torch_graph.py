"""A bundle's graph as torch ops: what eager torch and torch.compile (Inductor) run beside the planner's plans.

``torch_program(plan)`` interprets a plan's kernels (the bundle's reference plan: one op per kernel) op by op with
torch, each op as torch users write it, so torch.compile sees the decomposed graph and fuses it as Inductor does.
An op without a torch form here is refused by name (``TorchFormError``), never approximated. The results are
verified against the bundle's numpy reference before anything is timed (``benchmarks/torch_baseline.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from planner.core.plans import Expr, Load, Plan


class TorchFormError(ValueError):
    """An op of the graph has no torch form in this interpreter."""


def _heads(torch: Any, x: Any, a: Mapping[str, Any]) -> Any:
    heads, seq, offset, width = (int(a[k]) for k in ("heads", "seq", "offset", "width"))
    cols = x[:, offset:offset + width].reshape(-1, seq, heads, width // heads)
    return cols.permute(0, 2, 1, 3).reshape(-1, seq, width // heads)


def _merge(torch: Any, y: Any, a: Mapping[str, Any]) -> Any:
    heads = int(a["heads"])
    g, s, d = y.shape
    return y.reshape(g // heads, heads, s, d).permute(0, 2, 1, 3).reshape(-1, heads * d)


def _scores(torch: Any, q: Any, k: Any, a: Mapping[str, Any]) -> Any:
    s = q @ k.transpose(-1, -2)
    if a.get("causal"):
        hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(hidden, float("-inf"))
    return s


def torch_ops(torch: Any) -> dict[str, Callable[..., Any]]:
    """op name -> ``fn(attrs, *args)`` over torch tensors, the op table's numpy semantics in torch."""
    f = torch.nn.functional
    return {
        "Add": lambda a, x, y: x + y,
        "Sub": lambda a, x, y: x - y,
        "Mul": lambda a, x, y: x * y,
        "BiasAdd": lambda a, x, b: x + b,
        "BiasMul": lambda a, x, w: x * w,
        "Affine": lambda a, x: x * float(a["a"]) + float(a["b"]),
        "Square": lambda a, x: x * x,
        "Rsqrt": lambda a, x: torch.rsqrt(x),
        "Exp": lambda a, x: torch.exp(x),
        "Relu": lambda a, x: f.relu(x),
        "Silu": lambda a, x: f.silu(x),
        "Sigmoid": lambda a, x: torch.sigmoid(x),
        "Tanh": lambda a, x: torch.tanh(x),
        "GeluTanh": lambda a, x: f.gelu(x, approximate="tanh"),
        "GeluErf": lambda a, x: f.gelu(x),
        "RowMean": lambda a, x: x.mean(-1, keepdim=True),
        "RowSum": lambda a, x: x.sum(-1, keepdim=True),
        "RowMax": lambda a, x: x.amax(-1, keepdim=True),
        "SubRow": lambda a, x, r: x - r,
        "MulRow": lambda a, x, r: x * r,
        "DivRow": lambda a, x, r: x / r,
        "MatMul": lambda a, x, w: x @ w,
        "Heads": lambda a, x: _heads(torch, x, a),
        "Merge": lambda a, y: _merge(torch, y, a),
        "BatchScores": lambda a, q, k: _scores(torch, q, k, a),
        "BatchApply": lambda a, p, v: p @ v,
        "Attention": lambda a, q, k, v: f.scaled_dot_product_attention(
            q, k, v, is_causal=bool(a.get("causal")), scale=float(a["scale"])),
    }


def torch_program(torch: Any, plan: Plan) -> Callable[[Mapping[str, Any]], list[Any]]:
    """``run(inputs) -> outputs``: the plan's kernels in order, each body evaluated with torch ops."""
    ops = torch_ops(torch)
    missing = sorted({e.op for k in plan.kernels for e in k.body.walk()} - set(ops))
    if missing:
        raise TorchFormError(f"no torch form for op(s) {', '.join(missing)} (benchmarks/torch_graph.py)")

    def value(e: Expr | Load, env: Mapping[str, Any]) -> Any:
        if isinstance(e, Load):
            return env[e.tensor]
        return ops[e.op](e.attr_dict, *(value(x, env) for x in e.args))

    def run(inputs: Mapping[str, Any]) -> list[Any]:
        env = dict(inputs)
        for k in plan.kernels:
            env[k.out] = value(k.body, env)
        return [env[o] for o in plan.outputs]

    return run


__all__ = ["TorchFormError", "torch_ops", "torch_program"]

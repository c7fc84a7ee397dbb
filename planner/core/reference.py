"""The numpy reference executor: the oracle every candidate is checked against.

``device`` mode executes a plan kernel by kernel as hardware does: inside a
kernel every value lives in fp32 "registers"; each kernel output is rounded to
its tensor's dtype when it is stored.  Fused and unfused plans therefore differ
exactly as much as they would on a GPU (up to FMA and summation order).

``oracle`` mode evaluates the same bodies in fp64 without rounding at stores:
the graph's mathematical meaning.

Torch-backed Opaque nodes run through the evaluator the torch layer installs
(``planner.torch.need_evaluator``); the faces install it before planning a graph that holds one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from planner.core.dtypes import round_to
from planner.core.graph import Graph
from planner.core.inputs import RecipeInputs, nonnegative, random_inputs
from planner.core.ops import op_def
from planner.core.plans import Expr, Kernel, Load, Plan

MODES = ("device", "oracle")
__all__ = ["MODES", "ExecutionError", "execute_graph", "execute_plan", "random_inputs", "recipe_inputs"]


class ExecutionError(RuntimeError):
    """A plan could not be executed (missing input, bad shape, op failure)."""


def _work_dtype(mode: str) -> type[np.floating]:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return np.float32 if mode == "device" else np.float64


def prepare_inputs(
    tensors: Mapping[str, object], inputs: Mapping[str, np.ndarray], names: Sequence[str], mode: str
) -> dict[str, np.ndarray]:
    """Inputs as stored in memory: rounded to their dtype (unless the recipe drew them, already rounded),
    held in the working float type."""
    work = _work_dtype(mode)
    drawn = isinstance(inputs, RecipeInputs)
    mem: dict[str, np.ndarray] = {}
    for name in names:
        if name not in inputs:
            raise ExecutionError(f"missing input {name!r}")
        ttype = tensors[name]
        arr = np.asarray(inputs[name])
        if tuple(arr.shape) != tuple(ttype.shape):  # type: ignore[attr-defined]
            raise ExecutionError(
                f"input {name!r} has shape {list(arr.shape)}, expected {list(ttype.shape)}"  # type: ignore[attr-defined]
            )
        if drawn and arr.dtype == np.float32:  # the recipe's fp32 arrays hold values of their dtype exactly
            mem[name] = arr if work == np.float32 else arr.astype(work)
        elif arr.dtype == work == np.float32:  # fp32 holds the value exactly: round once, no float64 detour
            mem[name] = round_to(arr, ttype.dtype)  # type: ignore[attr-defined]
        else:
            mem[name] = round_to(arr.astype(np.float64), ttype.dtype).astype(work)  # type: ignore[attr-defined]
    return mem


def eval_expr(e: Expr | Load, mem: Mapping[str, np.ndarray], work: type[np.floating], memo: dict[int, np.ndarray]) -> np.ndarray:
    """Evaluate a kernel body in registers of type ``work``."""
    if isinstance(e, Load):
        try:
            return mem[e.tensor]
        except KeyError:
            raise ExecutionError(f"kernel reads {e.tensor!r} before any kernel stored it") from None
    key = id(e)
    if key in memo:
        return memo[key]
    args = [eval_expr(a, mem, work, memo) for a in e.args]
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(op_def(e.op).evaluate(args, e.attr_dict), dtype=work)
    memo[key] = out
    return out


def run_kernel(k: Kernel, mem: dict[str, np.ndarray], mode: str) -> np.ndarray:
    work = _work_dtype(mode)
    value = eval_expr(k.body, mem, work, {})
    if mode == "device":
        value = round_to(value, k.body.type.dtype)
    mem[k.out] = value
    return value


def execute_plan(plan: Plan, inputs: Mapping[str, np.ndarray], mode: str = "device") -> list[np.ndarray]:
    """Run every kernel in order; returns the graph outputs (in the working float type)."""
    input_names = sorted({r for k in plan.kernels for r in k.reads} - {k.out for k in plan.kernels})
    input_names += [o for o in plan.outputs if o not in input_names and all(k.out != o for k in plan.kernels)]
    mem = prepare_inputs(plan.tensors, inputs, input_names, mode)
    for k in plan.kernels:
        run_kernel(k, mem, mode)
    return [mem[o] for o in plan.outputs]


def execute_graph(graph: Graph, inputs: Mapping[str, np.ndarray], mode: str = "device") -> list[np.ndarray]:
    """The unfused graph: every op its own kernel, every result stored."""
    work = _work_dtype(mode)
    tensors = {n.id: n.type for n in graph.nodes}
    mem = prepare_inputs(tensors, inputs, [n.id for n in graph.inputs], mode)
    for n in graph.ops:
        with np.errstate(over="ignore", invalid="ignore"):
            v = np.asarray(op_def(n.op).evaluate([mem[i] for i in n.inputs], n.attr_dict), dtype=work)
        mem[n.id] = round_to(v, n.type.dtype) if mode == "device" else v
    return [mem[o] for o in graph.outputs]


def recipe_inputs(graph: Graph, seed: int = 0) -> tuple[RecipeInputs, list[np.ndarray]]:
    """The inputs a search of ``graph`` verifies on, and the reference's outputs on them: the recipe's, or their
    absolute values where the reference is NaN or infinite on the recipe and finite on those (a log of a region
    input that is a softmax's result); the recipe's still where neither is finite."""
    drawn = random_inputs(graph, seed=seed)
    expected = execute_graph(graph, drawn, "device")
    if all(np.isfinite(e).all() for e in expected):
        return drawn, expected
    positive = nonnegative(drawn)
    retried = execute_graph(graph, positive, "device")
    if all(np.isfinite(e).all() for e in retried):
        return positive, retried
    return drawn, expected

"""The one input recipe: seeded, scaled normal inputs that every checker and timer uses.

The search, ``run``, the composite check of a layer stack, ``export-candidates`` bundles
(and so the remote runner) and the tests all draw inputs this way, so a candidate is
verified on the same values wherever it runs.

``numpy.random.default_rng(seed).standard_normal(shape) * scale`` per graph input, in
graph order, rounded to the input's dtype. An input read as a GEMM's right operand,
shape (K, N), gets scale K^-1/2, as weight initialisers do: with unit weights a deep
stack's activations and attention logits grow with depth, and softmax then turns fp16
rounding differences between equally valid plans into errors far beyond the dtype's
tolerance. Every other input gets scale 1.

An input that carries integer indices (a model's token ids, which the torch importer binds as fp32: read by
the op table's ``Embedding``, or converted back with ``.long()`` right before an Opaque call that takes them)
gets ``integers(0, rows)`` instead, ``rows`` the table it indexes: normal values are no indices; 2 where the
indices are only converted to bool (an attention mask: 0s and 1s), 1 (index 0) where nothing says.

A search whose graph's reference is NaN or infinite on those inputs verifies on their absolute values instead
(:func:`nonnegative`), and its log says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import numpy as np

from planner.core.dtypes import round_to
from planner.core.errors import UsageError
from planner.core.graph import Graph, TensorType
from planner.core.kinds import OpKind
from planner.core.ops import GATHERS, op_def

RECIPE = (
    "numpy.random.default_rng(seed).standard_normal(shape) * scale per input, in this order, "
    "rounded to the input's dtype"
)


def input_scales(graph: Graph, scale: float = 1.0) -> dict[str, float]:
    """Each graph input's scale: ``scale`` K^-1/2 for a GEMM's right operand (K, N), else ``scale``."""
    fan_in = {
        graph[n.inputs[1]].id: graph[n.inputs[1]].type.shape[0]
        for n in graph.ops
        if op_def(n.op).kind == OpKind.MATMUL and graph[n.inputs[1]].op == "In"
    }
    return {n.id: scale / np.sqrt(fan_in.get(n.id, 1)) for n in graph.inputs}


#: the step the torch importer puts before a torch call that takes integer indices bound as fp32
INDEX_STEP = "torch.Tensor.long"


def index_rows(graph: Graph) -> dict[str, int]:
    """Graph inputs that carry integer indices, and how many rows they may index: the rows of the table an
    Embedding op, or an embedding call, takes beside them (1, so index 0 only, when no embedding says)."""
    out: dict[str, int] = {}
    for n in graph.ops:
        if n.op in GATHERS and graph[n.inputs[0]].op == "In":  # an Embedding op reads the ids themselves
            ids = n.inputs[0]
            out[ids] = min(out.get(ids, 2**31), graph[n.inputs[1]].type.shape[0])
            continue
        call = n.attr_dict.get("call") if n.op == "Opaque" else None
        steps = json.loads(call)["steps"] if isinstance(call, str) else []
        for i, step in enumerate(steps):
            args = step.get("args") or [None]
            if step.get("impl") != INDEX_STEP or not isinstance(args[0], dict) or set(args[0]) != {"$in"}:
                continue
            rows = [int(u["shapes"][1][0]) for u in steps if "embedding" in str(u.get("impl"))
                    and (u.get("args") or [None])[0] == {"$step": i} and len(u.get("shapes", [])) > 1]
            if not rows and _read_as_bool(steps, i):
                rows = [2]  # a mask: 0 and 1 (index 0 alone would mask every position)
            name = n.inputs[int(args[0]["$in"])]
            out[name] = min([out.get(name, 2**31), *rows]) if rows else 1
    return out


_BOOL = json.dumps({"$dtype": "bool"})


def _read_as_bool(steps: Sequence[Mapping], i: int) -> bool:
    """Is step ``i``'s value read only by conversions to bool (an attention mask of 0s and 1s)?"""
    readers = [u for u in steps if {"$step": i} in (u.get("args") or [])]
    return bool(readers) and all(_to_bool(u) for u in readers)


def _to_bool(step: Mapping) -> bool:
    """Is this call step a conversion to bool (``.to(torch.bool)``, in any of its aten forms)?"""
    return "to" in str(step.get("impl")).split(".") and _BOOL in json.dumps(step)


class RecipeInputs(dict[str, np.ndarray]):
    """Inputs the recipe drew: each value already representable in its tensor's dtype (rounded once when
    drawn), so an executor does not round it again (numpy's fp16 rounding of a verification's inputs was
    a quarter of planning a 32-layer transformer with the model backend)."""


def seeded_inputs(
    names: Sequence[str], types: Mapping[str, TensorType], seed: int, scales: Mapping[str, float],
    index_rows: Mapping[str, int] | None = None,
) -> RecipeInputs:
    """The recipe itself, for a graph or for a bundle that carries names, types and scales."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**63:
        raise UsageError(f"the input seed must be an integer from 0 to 2**63-1, got {str(seed)[:40]}")
    zero = [n for n in names if not (math.isfinite(scales.get(n, 1.0)) and scales.get(n, 1.0) > 0)]
    if zero:  # all-zero inputs "verify" every candidate (GELU(0) = ReLU(0) = 0): the check could not fail
        raise UsageError(f"input {zero[0]!r} has scale {scales[zero[0]]}: the recipe draws inputs of a positive scale")
    rng = np.random.default_rng(seed)
    out = RecipeInputs()
    for name in names:
        t = types[name]
        rows = (index_rows or {}).get(name)
        if rows is not None:
            out[name] = rng.integers(0, rows, t.shape).astype(np.float32)
            continue
        x = rng.standard_normal(t.shape, dtype=np.float32)  # drawn in fp32: half the work of fp64 draws
        x *= np.float32(scales.get(name, 1.0))
        out[name] = x if t.dtype == "fp32" else round_to(x, t.dtype)
    return out


class NonnegativeRecipe(RecipeInputs):
    """The recipe's inputs as their absolute values (:func:`nonnegative`)."""


def nonnegative(inputs: Mapping[str, np.ndarray]) -> NonnegativeRecipe:
    """The recipe's inputs as their absolute values: what a graph is verified on where its reference is NaN or
    infinite on the recipe itself (a region whose input is a softmax's or a norm's result, never negative in a
    model, read by a log or a square root); indices are nonnegative already."""
    return NonnegativeRecipe((name, np.abs(x)) for name, x in inputs.items())


def random_inputs(graph: Graph, seed: int = 0, scale: float = 1.0) -> RecipeInputs:
    """Seeded inputs for every graph input, already representable in its dtype (the module docstring)."""
    names = [n.id for n in graph.inputs]
    return seeded_inputs(names, {n.id: n.type for n in graph.inputs}, seed, input_scales(graph, scale),
                         index_rows(graph))

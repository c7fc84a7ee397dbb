"""The pipeline property test's random graphs: every op of the op table a kernel computes in registers, drawn
from the table (an op added there is fuzzed too), with MatMul, Opaque norms and Casts between dtypes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from planner.core.examples import fusable_ops, positive_value
from planner.core.graph import GraphBuilder
from planner.core.ops import OPS, example_operands

DIMS = (1, 2, 3, 5, 8, 9)
# every op a kernel computes in registers, from the op table (an op added there is fuzzed here too); GEMMs,
# biases and residual adds more often, so that epilogue and cuBLASLt candidates are common
KINDS = (*fusable_ops(), "MatMul", "MatMul", "MatMul", "BiasAdd", "BiasAdd", "Add", "Add", "Opaque", "Opaque")
DTYPES = ("fp16", "bf16", "fp32")

Choose = Callable[[Sequence[Any], str], Any]


def draw_op(b: GraphBuilder, pool: dict[str, tuple[int, ...]], kind: str, nid: str, choose: Choose,
            src: str | None = None) -> str:
    """Add one op of ``kind`` reading ``src`` (default: the newest value of ``pool``); ``choose(values, label)``
    picks every other choice. Further inputs are values of the pool with the shape the op's shape rule asks
    (fan-in) or fresh inputs; an op that cannot take ``src`` first takes a fresh value of one more leading
    dimension (``src`` may then be a further input: RoPE's cos and sin tiles)."""
    src = src if src is not None else list(pool)[-1]
    shape, dtype = pool[src], b.nodes[src].type.dtype
    if kind == "MatMul" and len(shape) == 2:
        w = b.input(f"{nid}.w", (shape[-1], choose(DIMS, f"{nid}.n")), dtype)
        return b.op(nid, kind, [src, w])
    if kind == "Opaque":
        return _opaque(b, nid, src, shape, dtype, choose)
    op = OPS[kind if kind in OPS and OPS[kind].kind.fuses else "Relu"]
    first, operands = src, example_operands(op, shape)
    if operands is None:
        lead = (2, *shape)
        operands = example_operands(op, lead)
        if operands is None:  # e.g. RotateHalf of an odd row: it has no halves
            return b.op(nid, "Relu", [src])
        first = b.op(f"{nid}.pre", "Affine", [b.input(f"{nid}.t", lead, dtype)], {"a": 1.5, "b": 0.25})
    ins = [first]
    for j, want in enumerate(operands, 1):
        same = [n for n, s in pool.items() if s == want and b.nodes[n].type.dtype == dtype]
        pick = choose([*same, None], f"{nid}.in{j}")
        ins.append(pick if pick is not None else b.input(f"{nid}.x{j}", want, dtype))
    for j in op.positive_inputs:
        ins[j] = positive_value(b, ins[j], f"{nid}.p{j}")
    return b.op(nid, op.name, ins, {a.name: choose(a.example_values(), f"{nid}.{a.name}") for a in op.attrs})


def _opaque(b: GraphBuilder, nid: str, src: str, shape: tuple[int, ...], dtype: str, choose: Choose) -> str:
    impl = choose(("layer_norm", "rms_norm", "softmax"), f"{nid}.impl")
    if shape[-1] < 3 and impl != "softmax":
        # a norm of one or two values is a step function near zero: LayerNorm of two values is +-1 unless they
        # differ by less than sqrt(eps), RMSNorm of one value is sign(x) unless |x| is near sqrt(eps) (a row mean
        # of a difference often is); any plan's rounding picks a side (1 run in 20 failed on the oracle allowance),
        # so such rows get a softmax, which is well-conditioned at any width
        impl = "softmax"
    ins = [src]
    if impl != "softmax" and choose((True, False), f"{nid}.weight"):
        ins.append(b.input(f"{nid}.g", (shape[-1],), dtype))
    return b.op(nid, "Opaque", ins, {"impl": impl})


@st.composite
def graphs(draw: st.DrawFn) -> dict:
    """A random graph as its JSON object (so hypothesis prints a shrunk example readably)."""

    def choose(values: Sequence[Any], label: str) -> Any:
        return draw(st.sampled_from(values), label=label)

    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    m = draw(st.sampled_from(DIMS), label="rows")
    b = GraphBuilder("random")
    pool: dict[str, tuple[int, ...]] = {}
    x = b.input("x", (m, draw(st.sampled_from(DIMS), label="cols")), dtype)
    pool[x] = b.nodes[x].type.shape
    n_ops = draw(st.integers(1, 7), label="ops")
    for i in range(n_ops):
        kind = draw(st.sampled_from(KINDS), label=f"op{i}")
        # mostly extend the newest value (chains); sometimes reach back (fan-out, residuals)
        names = list(pool)
        src = names[-1] if draw(st.booleans(), label=f"chain{i}") else draw(st.sampled_from(names), label=f"src{i}")
        nid = draw_op(b, pool, kind, f"n{i}", choose, src)
        pool[nid] = b.nodes[nid].type.shape
    consumed = {i for n in b.nodes.values() for i in n.inputs}
    sinks = [n.id for n in b.nodes.values() if n.op != "In" and n.id not in consumed]
    return b.build(sinks).to_json()

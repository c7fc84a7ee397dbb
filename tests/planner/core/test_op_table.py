"""The op table is complete: every op a kernel computes in registers fuses, runs on the CPU backend and passes
the output check, has CUDA source that compiles under NVRTC, is drawn by the property-test fuzzer, and has its
generated rules checked sound. An op added to the table with a piece forgotten fails here, by name; so do the
two ops this module adds at run time, an elementwise one and a reduction, each by one entry."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from _fuzz import draw_op

from planner.core.cost import load_device
from planner.core.examples import fusable_ops, op_example
from planner.core.graph import Graph, GraphBuilder
from planner.core.kinds import KernelKind
from planner.core.ops import OPS, OpDef, Reduction, register_op, same_shape
from planner.core.plans import Plan
from planner.core.reference import execute_graph, random_inputs
from planner.core.semantics import quiet
from planner.core.shapes import row_shape
from planner.core.tolerance import check_outputs
from planner.egraph.candidates import build_candidates
from planner.rules.check import check_text
from planner.rules.rulegen import fusion_rules, generated_text

FUSABLE = fusable_ops()

SOFTPLUS = OpDef(
    name="Softplus", kind="elementwise", arity=1, shape_rule=same_shape,
    numpy_fn=lambda xs, attrs: quiet(lambda x: np.log1p(np.exp(x)))(xs[0]),
    flops_per_elem=lambda attrs: 3.0, regs=lambda attrs: 8, code=lambda v, attrs: f"log1pf(expf({v[0]}))",
    fusable_inputs=(0,), doc="log(1 + e**x).",
)
ROW_MIN = OpDef(
    name="RowMin", kind="reduction", arity=1, shape_rule=row_shape,
    numpy_fn=lambda xs, attrs: quiet(lambda x: np.min(x, axis=-1, keepdims=True))(xs[0]),
    regs=lambda attrs: 8, flops_rule=lambda out, ins, attrs: float(np.prod(ins[0])), fusable_inputs=(0,),
    gemm_epilogue=False, reduction=Reduction(float("inf"), "fp_min({a}, {b})"),
    doc="Smallest value over the last dimension, kept as 1.",
)


@pytest.fixture
def added() -> Iterator[list[str]]:
    """Softplus and RowMin, each added to the table as a user adds an op: one entry."""
    for op in (SOFTPLUS, ROW_MIN):
        register_op(op)
    try:
        yield [SOFTPLUS.name, ROW_MIN.name]
    finally:
        for op in (SOFTPLUS, ROW_MIN):
            del OPS[op.name]


def _ops_of(plan: Plan) -> list[list[str]]:
    return [[e.op for e in k.body.walk()] for k in plan.kernels]


def _fused(name: str, graph: Graph) -> tuple[list[Plan], list[Plan]]:
    """(every candidate, those in which ``name`` shares a kernel with another op)."""
    plans = build_candidates(graph, load_device("h200"), cap=256, k=32).plans
    return plans, [p for p in plans if any(name in ops and len(ops) > 1 for ops in _ops_of(p))]


def check_on_the_cpu(name: str, backend: object, dtype: str = "fp32") -> None:
    graph = op_example(name, dtype)
    plans, fused = _fused(name, graph)
    assert fused, f"{name}: no candidate computes it in one kernel with a neighbour"
    inputs = random_inputs(graph, 0)
    want, oracle = execute_graph(graph, inputs), execute_graph(graph, inputs, "oracle")
    for plan in {p.key: p for p in [*plans[:6], *fused[:6]]}.values():
        got = backend.compile(plan).run(inputs)  # type: ignore[attr-defined]
        reason, _, _ = check_outputs(plan, got, want, oracle=oracle)
        assert reason is None, f"{name}: plan {plan.notation()} ({plan.composition()}) on the cpu backend: {reason}"


@pytest.fixture(scope="module")
def cpu():
    from backends.cpu.backend import CpuBackend
    from planner.backend import BackendUnavailable
    from planner.core.cost import load_device

    try:
        return CpuBackend(load_device("h200"), threads=1)
    except BackendUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")


@pytest.mark.parametrize("name", FUSABLE)
def test_every_fusable_op_fuses_runs_on_the_cpu_and_passes_the_output_check(name, cpu):
    check_on_the_cpu(name, cpu)


@pytest.mark.parametrize("name", ["Cast", "RowMax", "Div", "MaskAdd"])
def test_16_bit_examples_pass_the_output_check_too(name, cpu):
    check_on_the_cpu(name, cpu, "bf16")


def _cuda_kernels(names: list[str]) -> dict[str, list[object]]:
    from backends.cupy.codegen import generate

    out: dict[str, list[object]] = {}
    for name in names:
        _, fused = _fused(name, op_example(name))
        out[name] = [generate(k, p.tensors) for p in fused[:4] for k in p.kernels if k.kind != KernelKind.CUBLASLT]
    return out


def _compile_cuda(by_op: dict[str, list[object]]) -> dict[str, str]:
    from backends.cupy import nvrtc

    failed: dict[str, str] = {}
    for name, kernels in by_op.items():
        assert kernels, f"{name}: no generated CUDA kernel holds it"
        for kernel, res in zip(kernels, nvrtc.compile_each(kernels), strict=True):  # type: ignore[arg-type]
            if isinstance(res, nvrtc.NvrtcError):
                failed[name] = f"{kernel.name}: {str(res)[:300]}"  # type: ignore[attr-defined]
    return failed


@pytest.mark.nvrtc
def test_every_fusable_op_compiles_as_cuda_under_nvrtc():
    assert _compile_cuda(_cuda_kernels(FUSABLE)) == {}


def check_rules(name: str) -> None:
    rules = [r for r in fusion_rules() if r.op == name]
    if not OPS[name].fusable_inputs:  # read from memory only (RotateHalf's input): no register form to rule on
        assert not rules, name
        return
    assert rules, f"{name}: the op table generates no fusion rule for it"
    for ruleset in sorted({r.ruleset for r in rules}):
        results = check_text(generated_text(ruleset, rules), f"generated:{ruleset}", shipped=True, examples=15)
        assert results and all(r.ok for r in results), f"{name}: {[(r.verdict, r.detail) for r in results if not r.ok]}"


@pytest.mark.parametrize("name", FUSABLE)
def test_every_fusable_ops_generated_rules_are_checked_sound(name):
    check_rules(name)


@pytest.mark.parametrize("name", FUSABLE)
def test_the_fuzzer_draws_every_fusable_op(name):
    b = GraphBuilder("one")
    pool = {b.input("x", (3, 8), "fp32"): (3, 8)}
    added = draw_op(b, pool, name, "n0", choose=lambda values, label: values[0])
    assert b.nodes[added].op == name or name in {n.op for n in b.nodes.values()}, name


def test_an_elementwise_op_and_a_reduction_added_at_run_time_fuse_run_and_compile(added, cpu):
    for name in added:
        check_on_the_cpu(name, cpu)
        check_rules(name)
        b = GraphBuilder("one")
        pool = {b.input("x", (3, 8), "fp32"): (3, 8)}
        draw_op(b, pool, name, "n0", choose=lambda values, label: values[0])
        assert name in {n.op for n in b.nodes.values()}


@pytest.mark.nvrtc
def test_ops_added_at_run_time_compile_as_cuda(added):
    assert _compile_cuda(_cuda_kernels(added)) == {}


def test_a_reduction_without_its_start_value_and_combine_is_refused_by_name():
    with pytest.raises(ValueError, match="RowMinimum: an op of kind reduction, and only one, carries a Reduction"):
        OpDef(name="RowMinimum", kind="reduction", arity=1, shape_rule=row_shape,
              numpy_fn=lambda xs, attrs: np.min(xs[0], axis=-1, keepdims=True), fusable_inputs=(0,))


def test_columns_and_embedding_check_their_shapes_and_ids() -> None:
    """The layout ops of token ids and packed projections: their shape rules refuse what they cannot take, and
    Embedding's semantics refuse an id that is no row of the table (torch's embedding raises too)."""
    from planner.core.errors import OpError

    columns, embedding = OPS["Columns"], OPS["Embedding"]
    assert columns.out_shape([(6, 10)], {"offset": 4, "width": 6}) == (6, 6)
    with pytest.raises(OpError, match=r"columns \[6, 12\)"):
        columns.out_shape([(6, 10)], {"offset": 6, "width": 6})
    assert embedding.out_shape([(2, 3), (50, 8)], {}) == (6, 8)
    assert embedding.out_dtype(["fp32", "bf16"], {}) == "bf16"
    with pytest.raises(OpError, match="2-D table"):
        embedding.out_shape([(2, 3), (50,)], {})
    table = np.arange(15, dtype=np.float32).reshape(5, 3)
    np.testing.assert_array_equal(embedding.evaluate([np.array([[4.0], [0.0]]), table], {}), table[[4, 0]])
    np.testing.assert_array_equal(columns.evaluate([table], {"offset": 1, "width": 2}), table[:, 1:])
    for bad in (5.0, -1.0, 0.5, np.nan):
        with pytest.raises(IndexError, match="is not a row of a table of 5 rows"):
            embedding.evaluate([np.array([1.0, bad]), table], {})


def test_regroup_takes_the_same_elements_in_order_as_rows_of_its_width() -> None:
    from planner.core.errors import OpError

    regroup = OPS["Regroup"]
    assert regroup.out_shape([(6, 12)], {"width": 4}) == (18, 4)
    assert regroup.out_shape([(2, 3, 4)], {"width": 12}) == (2, 12)
    with pytest.raises(OpError, match="rows of 5 elements"):
        regroup.out_shape([(6, 12)], {"width": 5})
    x = np.arange(72, dtype=np.float32).reshape(6, 12)
    np.testing.assert_array_equal(regroup.evaluate([x], {"width": 4}), x.reshape(18, 4))
    np.testing.assert_array_equal(regroup.evaluate([x[:, ::2]], {"width": 3}), x[:, ::2].reshape(12, 3))

"""Mechanical fusion rules come from the op table: adding an elementwise op is one OpDef entry."""

from __future__ import annotations

import re

import numpy as np
import pytest
from testpaths import FIXTURES

from planner.core.cost import load_device
from planner.core.graph import GraphBuilder
from planner.core.ops import OPS, OpDef, register_op, same_shape
from planner.core.reference import execute_graph, execute_plan, random_inputs
from planner.core.tolerance import check_outputs
from planner.egraph.candidates import build_candidates
from planner.rules.check import check_files
from planner.rules.files import parse_rule_text, shipped_rules
from planner.rules.rulegen import fusion_rules, generated_text

BEFORE = FIXTURES / "mechanical_rules" / "before_generation.egg"
_NOT_VARS = {"rewrite", "rule", "subsume", "K", "Ew", "Forced", "MatMul"}


def _alpha(printed: str) -> str:
    """A printed rule with its pattern variables renamed v0, v1, ... by first appearance."""
    names: dict[str, str] = {}

    def rename(m: re.Match[str]) -> str:
        word = m.group(0)
        if word in _NOT_VARS or word[0].isupper() or m.string[max(0, m.start() - 9):m.start()] == ":ruleset ":
            return word
        return names.setdefault(word, f"v{len(names)}")

    return re.sub(r"(?<![\w:\"])[A-Za-z_][\w]*", rename, printed)


def _canonical(text: str) -> set[str]:
    """Each rule command as egglog prints it, pattern variables renamed by first appearance."""
    return {
        _alpha(" ".join(str(cmd).split()))
        for cmd in parse_rule_text(text, "<rules>", shipped=True)
        if type(cmd).__name__ in ("RewriteCommand", "RuleCommand")
    }


def test_generated_rules_equal_the_hand_written_ones_they_replace():
    before = _canonical(BEFORE.read_text())
    assert len(before) == 32
    old_ops = {"BiasAdd", "Add", "Mul", "Affine", "Relu", "GeluTanh", "GeluErf", "Silu", "Stage"}
    rules = [r for r in fusion_rules() if r.op in old_ops]  # the ops the table had then
    generated = set()
    for ruleset in ("limits", "elementwise", "epilogue"):
        text = generated_text(ruleset, rules)
        generated |= _canonical(("(ruleset limits)\n" if ruleset == "limits" else "") + text)
    assert generated == before
    assert len(rules) == 32


def test_hand_written_files_hold_no_mechanical_rule():
    generated = {r.text for r in fusion_rules()}
    for rf in shipped_rules():
        if not rf.path.startswith("generated:"):
            assert not _canonical(rf.text) & _canonical("(ruleset limits)(ruleset elementwise)(ruleset epilogue)\n"
                                                        + "\n".join(generated)), rf.path


def test_an_op_opts_out_of_gemm_epilogues():
    assert not [r for r in fusion_rules() if r.op in ("Stage", "Sqrt", "Rsqrt") and r.ruleset == "epilogue"]
    assert [r.input for r in fusion_rules() if r.op == "Div" and r.ruleset == "epilogue"] == [0]  # the dividend only
    assert {r.ruleset for r in fusion_rules() if r.op == "Relu"} == {"elementwise", "epilogue", "limits"}


# ---------------------------------------------------------------- adding an op is one entry


ABS = OpDef(
    name="Abs",
    kind="elementwise",
    arity=1,
    shape_rule=same_shape,
    numpy_fn=lambda xs, attrs: np.abs(xs[0]),
    flops_per_elem=lambda attrs: 1.0,
    regs=lambda attrs: 4,
    code=lambda v, attrs: f"fabsf({v[0]})",
    fusable_inputs=(0,),
    torch_names=("torch.abs", "torch.Tensor.abs"),
    doc="|x|.",
)


@pytest.fixture
def new_op():
    """An op the table does not have, added as a user would add one: one entry."""
    register_op(ABS)
    try:
        yield ABS
    finally:
        del OPS["Abs"]


def _chain():
    b = GraphBuilder("abs-chain")
    b.input("x", (64, 32), "fp32")
    b.op("s1", "Abs", ["x"])
    b.op("r", "Relu", ["s1"])
    b.op("s2", "Abs", ["r"])
    return b.build(["s2"])


def test_a_new_op_fuses_into_one_kernel_that_runs_on_the_cpu(new_op):
    from backends.cpu.backend import CpuBackend
    from planner.backend import BackendUnavailable

    graph = _chain()
    cands = build_candidates(graph, load_device("h200"))
    one = [p for p in cands.plans if len(p.kernels) == 1]
    assert one and one[0].kernels[0].kind == "elementwise"
    assert cands.best.key == one[0].key  # the cost model prefers the fused kernel
    feed = random_inputs(graph, 0)
    expected = execute_graph(graph, feed)
    try:
        backend = CpuBackend(cands.spec)
    except BackendUnavailable as exc:
        pytest.skip(f"no C compiler: {exc}")
    outs = backend.compile(one[0]).run(feed)
    reason, _, _ = check_outputs(one[0], outs, expected)
    assert reason is None
    np.testing.assert_allclose(outs[0], execute_plan(one[0], feed)[0], rtol=1e-6)


def test_a_new_op_becomes_a_gemm_epilogue_and_its_rules_are_checked(new_op):
    b = GraphBuilder("gemm-abs")
    b.input("a", (32, 16), "fp32")
    b.input("w", (16, 8), "fp32")
    b.op("mm", "MatMul", ["a", "w"])
    b.op("sq", "Abs", ["mm"])
    graph = b.build(["sq"])
    kinds = {tuple(k.kind for k in p.kernels) for p in build_candidates(graph, load_device("h200")).plans}
    assert ("gemm_epilogue",) in kinds
    results = [r for r in check_files(examples=20) if "(Abs " in r.rule.text]
    assert {r.rule.path for r in results} == {"generated:elementwise", "generated:epilogue", "generated:limits"}
    assert all(r.ok for r in results)


def test_the_torch_importer_maps_a_new_op_from_its_table_entry(new_op):
    torch = pytest.importorskip("torch")
    from planner.torch.importer import import_module

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.abs(torch.relu(x)).abs()

    graph = import_module(M(), (torch.randn(4, 8),)).graph
    assert [n.op for n in graph.ops] == ["Relu", "Abs", "Abs"]

"""The torch baseline's graph interpreter (benchmarks/torch_graph.py): a plan run op by op in torch equals the
numpy reference, fused attention included, and an op it has no torch form for is refused by name."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from testpaths import ROOT

from planner.core.cost import load_device
from planner.core.examples import attention, ew_chain, transformer
from planner.core.reference import execute_plan, random_inputs
from planner.core.tolerance import check_outputs
from planner.egraph.candidates import build_candidates

torch = pytest.importorskip("torch")
sys.path.insert(0, str(ROOT))
from benchmarks.torch_graph import TorchFormError, torch_program  # noqa: E402


def _check(plan, graph) -> None:
    inputs = random_inputs(graph, seed=2)
    got = torch_program(torch, plan)({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in inputs.items()})
    reason, _, _ = check_outputs(plan, [g.numpy() for g in got], execute_plan(plan, inputs, mode="device"),
                                 oracle=execute_plan(plan, inputs, mode="oracle"))
    assert reason is None


def test_a_transformer_layer_op_by_op_equals_the_reference() -> None:
    graph = transformer(layers=1, d_model=64, seq=16, dtype="fp32")
    cands = build_candidates(graph, load_device("h200"))
    unfused = max(cands.plans, key=lambda p: len(p.kernels))
    _check(unfused, graph)


def test_a_fused_attention_kernel_runs_as_torchs_scaled_dot_product_attention() -> None:
    graph = attention(batch=2, seq=9, d_model=24, heads=3, dtype="fp32", causal=True)
    plan = next(p for p in build_candidates(graph, load_device("h200")).plans
                if any(k.body.op == "Attention" for k in p.kernels))
    _check(plan, graph)


def test_an_op_without_a_torch_form_is_refused_by_name() -> None:
    plan = build_candidates(ew_chain(2, 64, "fp32", fat_temps=4), load_device("h200")).plans[0]
    with pytest.raises(TorchFormError, match="no torch form for op.*Stage"):
        torch_program(torch, plan)

"""GPU checks of the cupy backend (marker ``gpu``: skipped without cupy and a CUDA device)."""

import numpy as np
import pytest

from backends.cupy.bundle import bundle_from_json, export_bundle
from backends.cupy.runner import time_bundle
from backends.cupy.verify import allclose_report
from backends.reference import execute_plan
from planner.candidates import build_candidates
from planner.cli import main
from planner.cost import load_device
from planner.examples import ew_chain, mlp_epilogue
from planner.graph import GraphBuilder
from planner.ops import OPS

pytestmark = pytest.mark.gpu

H200 = load_device("h200")


def _executor():
    from backends.cupy.gpu import CupyExecutor

    return CupyExecutor()


@pytest.mark.parametrize(("m", "n", "k", "dtype"), [(24, 40, 36, "fp16"), (130, 136, 72, "bf16"), (16, 512, 256, "fp16")])
def test_every_mlp_epilogue_candidate_matches_the_reference(m, n, k, dtype):
    cands = build_candidates(mlp_epilogue(m, n, k, dtype), "h200")
    bundle = bundle_from_json(export_bundle(cands))
    result = time_bundle(bundle, _executor(), warmup=1, repeats=3)
    lib_ok = dtype != "bf16"  # cupy has no bfloat16 dtype for nvmath-python
    bad = [
        (c["plan"], c["composition"], c["verdict"])
        for c in result["candidates"]
        if c["verdict"] != "timed" and (lib_ok or "cublaslt" not in c["composition"])
    ]
    assert not bad
    kinds = {f["kind"] for c in result["candidates"] for f in c["kernels"] if c["verdict"] == "timed"}
    assert kinds == ({"cublaslt", "gemm_epilogue", "elementwise"} if lib_ok else {"gemm_epilogue", "elementwise"})


def test_elementwise_chains_vector_and_tail_paths():
    for g in (ew_chain(4, 2**20 + 3, "fp32"), ew_chain(3, 1001, "fp16"), ew_chain(3, 4099, "bf16")):
        bundle = bundle_from_json(export_bundle(build_candidates(g, "h200")))
        result = time_bundle(bundle, _executor(), warmup=0, repeats=1)
        assert all(c["verdict"] == "timed" for c in result["candidates"]), g.name


def _epilogue_graph(epilogue: str, dtype: str, m=64, n=96, k=128):
    b = GraphBuilder(f"lt-{epilogue}")
    b.input("x", (m, k), dtype)
    b.input("w", (k, n), dtype)
    y = b.op("mm", "MatMul", ["x", "w"])
    from planner.ops import CUBLASLT_EPILOGUES

    for i, op in enumerate(CUBLASLT_EPILOGUES[epilogue]):
        if OPS[op].arity == 2:
            b.input("b", (n,), dtype)
            y = b.op(f"e{i}", op, [y, "b"])
        else:
            y = b.op(f"e{i}", op, [y])
    return b.build([y])


@pytest.mark.parametrize("epilogue", ["DEFAULT", "BIAS", "RELU", "RELU_BIAS", "GELU", "GELU_BIAS"])
def test_cublaslt_epilogues_match_the_reference(epilogue):
    from backends.cupy.backend import CupyBackend

    g = _epilogue_graph(epilogue, "fp16")
    cands = build_candidates(g, "h200")
    plan = next(p for p in cands.plans if len(p.kernels) == 1 and p.kernels[0].epilogue == epilogue)
    inputs = bundle_from_json(export_bundle(cands)).make_inputs()
    compiled = CupyBackend(H200).compile(plan)
    (got,) = compiled.run(inputs)
    (want,) = execute_plan(plan, inputs, mode="oracle")
    ok, max_abs, max_rel = allclose_report(got, want, "fp16")
    assert ok, (epilogue, max_abs, max_rel)
    timing = compiled.time(inputs, warmup=1, repeats=3)
    assert len(timing.samples_us) == 3 and timing.median_us > 0


def test_cublaslt_gelu_is_the_tanh_form():
    """In fp32 the library's GELU is closer to the tanh form than to erf, within fp32 tolerance."""
    from backends.cupy.backend import CupyBackend

    g = _epilogue_graph("GELU_BIAS", "fp32", m=128, n=128, k=64)
    cands = build_candidates(g, "h200")
    plan = next(p for p in cands.plans if len(p.kernels) == 1 and p.kernels[0].epilogue == "GELU_BIAS")
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((128, 64)).astype(np.float32) * 0.35,
              "w": rng.standard_normal((64, 128)).astype(np.float32) * 0.35,
              "b": rng.standard_normal(128).astype(np.float32)}
    (got,) = CupyBackend(H200).compile(plan).run(inputs)
    (tanh_ref,) = execute_plan(plan, inputs, mode="oracle")
    pre = inputs["x"].astype(np.float64) @ inputs["w"] + inputs["b"]
    erf_ref = OPS["GeluErf"].evaluate([pre], {})
    assert np.abs(tanh_ref - erf_ref).max() > 1e-4  # the two forms are distinguishable here
    ok, max_abs, _ = allclose_report(got, tanh_ref, "fp32")
    assert ok, max_abs
    assert np.abs(got - tanh_ref).max() < np.abs(got - erf_ref).max()


def test_kernel_facts_from_the_driver_match_nvcc_expectations():
    from backends.cupy.backend import CupyBackend

    fat = build_candidates(ew_chain(4, 2**20, "fp32", fat_temps=48), "h200")
    plan = next(p for p in fat.plans if len(p.kernels) == 1)
    compiled = CupyBackend(H200).compile(plan)
    (facts,) = compiled.kernel_facts
    assert facts["regs"] > 128 and facts["occupancy"] == 1
    lean = build_candidates(ew_chain(4, 2**20, "fp32"), "h200")
    lplan = next(p for p in lean.plans if len(p.kernels) == 1)
    (lf,) = CupyBackend(H200).compile(lplan).kernel_facts
    assert lf["regs"] < 64 and lf["occupancy"] >= 6


def test_cuda_graph_replay_is_timed():
    from backends.cupy.backend import plan_candidate
    from backends.cupy.bundle import Candidate

    cands = build_candidates(ew_chain(4, 2**20, "fp32"), "h200")
    unfused = cands.unfused
    cand: Candidate = plan_candidate(unfused)
    x = np.random.default_rng(0).standard_normal(2**20).astype(np.float32)
    prep = _executor().prepare(cand, {"x": x})
    prep.run()
    assert prep.time_graph(1, 3) > 0


def test_bench_c05_modes_on_the_gpu(capsys):
    assert main(["bench", "c05", "--mode", "modes", "--n", str(2**22)]) == 0
    out = capsys.readouterr().out
    assert "measured on" in out and "fat/fused" in out

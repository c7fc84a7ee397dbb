"""GPU checks of the cupy backend (marker ``gpu``: skipped without cupy and a CUDA device).

The GPU machine has no egglog: these tests read the bundles in tests/data/gpu
(``tests/gpu_bundles.py``; kept current by a CPU test) and import nothing that
needs egglog.
"""


import numpy as np
import pytest
from testpaths import GPU_DATA

from backends.cupy.bundle import load_bundle
from backends.cupy.runner import time_bundle
from backends.cupy.verify import allclose_report
from planner.core.cost import load_device
from planner.core.ops import OPS
from planner.core.reference import execute_plan

pytestmark = pytest.mark.gpu

H200 = load_device("h200")
DATA = GPU_DATA


def _bundle(name):
    return load_bundle(DATA / f"{name}.json")


def _executor():
    from backends.cupy.gpu import CupyExecutor

    return CupyExecutor()


@pytest.mark.parametrize("name", ["mlp_fp16", "mlp_bf16", "mlp_decode"])
def test_every_mlp_epilogue_candidate_matches_the_reference(name):
    result = time_bundle(_bundle(name), _executor(), warmup=1, repeats=3)
    lib_ok = name != "mlp_bf16"  # cupy has no bfloat16 dtype for nvmath-python
    bad = [
        (c["plan"], c["composition"], c["verdict"])
        for c in result["candidates"]
        if c["verdict"] != "timed" and (lib_ok or "cublaslt" not in c["composition"])
    ]
    assert not bad
    kinds = {f["kind"] for c in result["candidates"] for f in c["kernels"] if c["verdict"] == "timed"}
    assert kinds == ({"cublaslt", "gemm_epilogue", "elementwise"} if lib_ok else {"gemm_epilogue", "elementwise"})


@pytest.mark.parametrize("name", ["ew_fp32", "ew_fp16", "ew_bf16"])
def test_elementwise_chains_vector_and_tail_paths(name):
    result = time_bundle(_bundle(name), _executor(), warmup=0, repeats=1)
    assert all(c["verdict"] == "timed" for c in result["candidates"]), result["candidates"]


@pytest.mark.parametrize("name", ["rows_ln_fp32", "rows_ln_fp16", "rows_softmax_bf16"])
def test_row_kernels_match_the_reference(name):
    """LayerNorm and softmax row kernels (one thread a row; a 16-bit row longer than the row buffer)."""
    result = time_bundle(_bundle(name), _executor(), warmup=0, repeats=1)
    assert all(c["verdict"] == "timed" for c in result["candidates"]), result["candidates"]


@pytest.mark.parametrize("name", ["attn_fp32", "attn_masked_bf16"])
def test_attention_kernels_match_the_reference(name):
    """Heads, Merge, GroupRepeat, BatchScores, BatchApply and the fused (masked) attention kernel, in every
    candidate of a causal fp32 and a padding-masked bf16 attention."""
    result = time_bundle(_bundle(name), _executor(), warmup=0, repeats=1)
    assert all(c["verdict"] == "timed" for c in result["candidates"]), result["candidates"]
    plans = [c["plan"] for c in result["candidates"]]  # e.g. {standalone[Heads] ; ... ; standalone[Attention] ; ...}
    assert any("Attention]" in p for p in plans) and any("BatchScores]" in p for p in plans), plans


def _lt_plan(name, epilogue):
    b = _bundle(name)
    cand = next(c for c in b.candidates if c.plan.kernels[0].epilogue == epilogue)
    return b, cand.plan


@pytest.mark.parametrize("epilogue", ["DEFAULT", "BIAS", "RELU", "RELU_BIAS", "GELU", "GELU_BIAS"])
def test_cublaslt_epilogues_match_the_reference(epilogue):
    from backends.cupy.backend import CupyBackend

    b, plan = _lt_plan(f"lt_{epilogue}", epilogue)
    inputs = b.make_inputs()
    compiled = CupyBackend(H200).compile(plan)
    (got,) = compiled.run(inputs)
    (want,) = execute_plan(plan, inputs, mode="oracle")
    ok, max_abs, max_rel = allclose_report(got, want, "fp16")
    assert ok, (epilogue, max_abs, max_rel)
    timing = compiled.time(inputs, warmup=1, repeats=3)
    assert len(timing.samples_us) == 3 and timing.median_us > 0


def test_cublaslt_gelu_is_the_tanh_form():
    """In fp32 the library's GELU is closer to the tanh form than to erf.  Its precision is undocumented and
    not yet measured: device_smoke.py's ``gelu`` check prints both errors; a bound follows from them."""
    from backends.cupy.backend import CupyBackend

    _, plan = _lt_plan("lt_gelu_fp32", "GELU_BIAS")
    rng = np.random.default_rng(1)
    inputs = {
        "x": rng.standard_normal((128, 64)).astype(np.float32) * 0.35,
        "w": rng.standard_normal((64, 128)).astype(np.float32) * 0.35,
        "b": rng.standard_normal(128).astype(np.float32),
    }
    (got,) = CupyBackend(H200).compile(plan).run(inputs)
    (tanh_ref,) = execute_plan(plan, inputs, mode="oracle")
    pre = inputs["x"].astype(np.float64) @ inputs["w"] + inputs["b"]
    erf_ref = OPS["GeluErf"].evaluate([pre], {})
    assert np.abs(tanh_ref - erf_ref).max() > 1e-4  # the two forms are distinguishable here
    assert np.abs(got - tanh_ref).max() < np.abs(got - erf_ref).max()


def test_kernel_facts_from_the_driver():
    from backends.cupy.backend import CupyBackend

    (fat,) = [c.plan for c in _bundle("fat").candidates]
    (facts,) = CupyBackend(H200).compile(fat).kernel_facts
    assert facts["regs"] > 128 and facts["occupancy"] == 1
    (lean,) = [c.plan for c in _bundle("lean").candidates]
    (lf,) = CupyBackend(H200).compile(lean).kernel_facts
    assert lf["regs"] < 64 and lf["occupancy"] >= 6


def test_cuda_graph_replay_is_timed():
    from backends.cupy.backend import plan_candidate

    b = _bundle("ew_fp32")
    prep = _executor().prepare(plan_candidate(b.reference), b.make_inputs())
    prep.run()
    assert prep.time_graph(1, 3) > 0


def test_c05_modes_on_the_gpu(tmp_path, capsys):
    import json

    from backends.cupy import c05
    from backends.cupy.__main__ import main

    variants = [("naive", 4, _bundle("ew_fp32").reference), ("fused", 4, _bundle("lean").candidates[0].plan),
                ("fat", 4, _bundle("fat").candidates[0].plan)]
    data = c05.c05_bundle(variants, "modes", 2**20, 256, H200, [])
    path = tmp_path / "c05.json"
    path.write_text(json.dumps(data))
    assert main(["c05", str(path)]) == 0
    out = capsys.readouterr().out
    assert "measured on" in out and "fat/fused" in out

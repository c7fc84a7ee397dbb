"""CUDA generation and offline kernel facts (nvcc -arch=sm_90 where nvcc exists)."""

import re
from dataclasses import replace

import pytest
from gpu_bundles import example_kernels

from backends.cupy.codegen import CodegenError, elementwise_kernel, generate
from backends.cupy.facts import (
    Resources,
    annotate_candidates,
    compile_many,
    occupancy,
    parse_resource_usage,
)
from backends.cupy.kernel import GEMM_TILE, sanitize
from planner.core.cost import BUILTIN_DEVICES, load_device
from planner.core.examples import ew_chain, mlp_epilogue, softmax
from planner.core.graph import GraphBuilder, TensorType
from planner.egraph.candidates import build_candidates

H200 = load_device("h200")


@pytest.fixture(scope="session", autouse=True)
def _nvcc_cache(tmp_path_factory):
    """A fresh cache per session: every kernel really compiles once, then is reused."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSION_PLANNER_CACHE", str(tmp_path_factory.mktemp("nvcc-cache")))
        yield


@pytest.fixture(scope="module")
def generated():
    return example_kernels()


@pytest.fixture(scope="module")
def resources(generated):
    kernels = [c for _, _, c in generated.values()]
    return dict(zip((c.digest for c in kernels), compile_many(kernels), strict=True))


@pytest.mark.nvcc
def test_every_example_kernel_compiles_for_sm90(generated, resources):
    assert len(generated) >= 20
    kinds = {c.kind for _, _, c in generated.values()}
    assert kinds == {"elementwise", "gemm_epilogue", "standalone"}
    for digest, (gname, k, _) in generated.items():
        res = resources[digest]
        assert 0 < res.regs <= 255, (gname, k.describe())
        assert res.spill_bytes == 0, (gname, k.describe(), res)


@pytest.mark.nvcc
def test_fat_probe_presses_registers_and_lean_chain_does_not(generated, resources):
    fat = [d for d, (g, k, _) in generated.items() if "fat48" in g and k.ops.count("Stage") and len(k.ops) == 7]
    lean = [
        d
        for d, (g, k, _) in generated.items()
        if g.startswith("ew-chain-k4-16777216-fp32") and len(k.ops) == 6 and "Stage" not in k.ops
    ]
    assert fat and lean
    fat_regs = resources[fat[0]].regs
    lean_regs = resources[lean[0]].regs
    assert fat_regs > 128
    assert lean_regs <= 48
    assert occupancy(H200, fat_regs, 256) == 1
    assert occupancy(H200, lean_regs, 256) == 8


@pytest.mark.nvcc
def test_gemm_epilogue_kernel_uses_tensor_cores_and_shared_memory(generated, resources):
    gemm = [(c, resources[d]) for d, (_, _, c) in generated.items() if c.kind == "gemm_epilogue"]
    assert gemm
    for c, res in gemm:
        assert "wmma::mma_sync" in c.source
        assert res.smem_bytes > 0
        assert occupancy(H200, res.regs, c.block, res.smem_bytes) >= 1


def test_vector_width_follows_dtype_and_bias_alignment():
    def fused(g):
        c = build_candidates(g, load_device("h200"))
        return next(p for p in c.plans if len(p.kernels) == 1 or p.partition == (1, 3))

    p32 = fused(ew_chain(2, 4096, "fp32"))
    assert generate(p32.kernels[0], p32.tensors).vec == 4
    p16 = fused(ew_chain(2, 4096, "fp16"))
    assert generate(p16.kernels[0], p16.tensors).vec == 8
    # bias of 12 columns: 8-wide fp16 vectors would straddle rows -> scalar path only
    mlp = build_candidates(mlp_epilogue(8, 12, 16, "fp16"), load_device("h200"))
    ew = next(k for p in mlp.plans for k in p.kernels if k.kind == "elementwise" and "BiasAdd" in k.ops)
    c = elementwise_kernel(ew, mlp.plans[0].tensors)
    assert c.vec == 1
    assert "% 12LL" in c.source


def test_graph_names_never_reach_the_source():
    b = GraphBuilder("names")
    b.input("Secret.input_name", (1000,), "fp16")
    b.op("layer.0.Weird_Stage", "Relu", ["Secret.input_name"])
    b.op("layer.0.out", "GeluTanh", ["layer.0.Weird_Stage"])
    g = b.build(["layer.0.out"])
    p = next(p for p in build_candidates(g, load_device("h200")).plans if len(p.kernels) == 1)
    c = generate(p.kernels[0], p.tensors)
    for name in ("Secret", "Weird_Stage", "layer.0"):
        assert name not in c.source.replace(c.name, "")
    assert re.fullmatch(r"fp_ew_[A-Za-z0-9_]+", c.name)
    assert c.params == ("Secret.input_name", "layer.0.out")
    assert sanitize('x"); system("rm -rf /') == "x____system__rm__rf__"
    assert re.fullmatch(r"[A-Za-z0-9_]*", sanitize("a" * 100 + "\n*/#"))


def test_opaque_and_library_kernels_are_not_generated():
    cands = build_candidates(mlp_epilogue(64, 64, 64, "fp16"), load_device("h200"))
    lt = next(k for p in cands.plans for k in p.kernels if k.kind == "cublaslt")
    with pytest.raises(CodegenError, match="cublaslt"):
        generate(lt, cands.plans[0].tensors)


def test_custom_gemm_rejects_fp32_with_a_clear_error():
    cands = build_candidates(mlp_epilogue(64, 64, 64, "fp32"), load_device("h200"))
    k = next(k for p in cands.plans for k in p.kernels if k.kind == "gemm_epilogue")
    with pytest.raises(CodegenError, match="fp16 or bf16"):
        generate(k, cands.plans[0].tensors)


def test_a_row_kernel_of_more_rows_than_cudas_grid_is_refused_by_name():
    """A row kernel launches a block per row: past 2^31 - 1 rows it cannot launch, and says so."""
    plan = next(p for p in build_candidates(softmax(4, 8, "fp32"), load_device("h200")).plans if len(p.kernels) == 1)
    (k,) = plan.kernels
    tensors = {n: replace(t, shape=(2**31, *t.shape[1:])) if isinstance(t, TensorType) else t
               for n, t in plan.tensors.items()}
    with pytest.raises(CodegenError, match=f"{k.out!r}: 2147483648 rows"):
        generate(k, tensors)


def test_the_cost_models_gemm_tile_is_the_generated_kernels():
    """The device specs cost a generated GEMM by its tile count (``DeviceSpec.gemm_tile``): the tile the kernel uses."""
    tiled = [d for d in BUILTIN_DEVICES.values() if d.gemm_tile]
    assert tiled and all(d.gemm_tile == GEMM_TILE[0] == GEMM_TILE[1] for d in tiled)


def test_parse_resource_usage():
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'fp_ew_a_1' for 'sm_90'
ptxas info    : Function properties for fp_ew_a_1
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 8 bytes cumulative stack size, 29184 bytes smem
ptxas info    : Compiling entry function 'fp_ew_b_2' for 'sm_90'
ptxas info    : Function properties for fp_ew_b_2
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, used 0 barriers, 380 bytes cmem[0]
"""
    assert parse_resource_usage(text, "fp_ew_a_1") == Resources(255, 4, 8, 29184)
    assert parse_resource_usage(text, "fp_ew_b_2") == Resources(30, 0, 0, 0)


@pytest.mark.parametrize(
    ("device", "regs", "block", "smem", "blocks"),
    [
        ("h200", 32, 256, 0, 8),
        ("h200", 128, 256, 0, 2),
        ("h200", 129, 256, 0, 1),
        ("h200", 255, 256, 0, 1),
        ("h200", 96, 256, 29184, 2),
        ("h200", 16, 64, 0, 32),
        ("rtx5090", 30, 256, 0, 6),
        ("rtx5090", 207, 256, 0, 1),
        ("h200", 40, 256, 120_000, 1),
    ],
)
def test_analytic_occupancy(device, regs, block, smem, blocks):
    assert occupancy(load_device(device), regs, block, smem) == blocks


@pytest.mark.nvcc
def test_measured_registers_recost_only_where_the_spec_asks():
    g = mlp_epilogue(256, 256, 256, "fp16")
    seed = build_candidates(g, load_device("seed-k4"))
    before = {p.key: p.est_us for p in seed.plans}
    annotate_candidates(seed)
    assert {p.key: p.est_us for p in seed.plans} == before
    custom = [k for p in seed.plans for k in p.kernels if k.kind != "cublaslt"]
    assert custom and all({"regs", "spill_bytes", "occupancy"} <= set(k.facts) for k in custom)
    seed_fused = next(p for p in seed.plans if p.partition == (4,) and p.kernels[0].kind == "gemm_epilogue")
    assert seed_fused.kernels[0].cost.regs == 160  # the seed's table, not the compiled kernel's count
    h = annotate_candidates(build_candidates(g, load_device("h200")))
    fused = next(p for p in h.plans if p.partition == (4,))
    (k,) = fused.kernels
    assert k.cost.regs == k.facts["regs"]  # measured, not the op table's 160
    assert fused.to_json()["kernels"][0]["occupancy"] == k.facts["occupancy"]


def test_plan_with_facts_recosts_from_gpu_style_records():
    from backends.cupy.facts import plan_with_facts

    cands = build_candidates(mlp_epilogue(256, 256, 256, "fp16"), load_device("h200"))
    plan = next(p for p in cands.plans if p.partition == (1, 3) and p.kernels[0].kind == "cublaslt")
    facts = [{"kind": "cublaslt"}, {"kind": "elementwise", "regs": 250, "spill_bytes": 64, "occupancy": 1}]
    out = plan_with_facts(H200, plan, facts)
    assert out.kernels[0] is plan.kernels[0]
    ew = out.kernels[1]
    assert ew.cost.regs == 250 and ew.cost.spills and ew.facts["occupancy"] == 1
    assert ew.cost.est_us > plan.kernels[1].cost.est_us  # spill penalty from the measured spill bytes
    seed = build_candidates(mlp_epilogue(256, 256, 256, "fp16"), load_device("seed-k4"))
    splan = next(p for p in seed.plans if p.partition == (1, 3) and p.kernels[0].kind == "cublaslt")
    assert plan_with_facts(load_device("seed-k4"), splan, facts).kernels[1].cost == splan.kernels[1].cost
    with pytest.raises(ValueError, match="fact records"):
        plan_with_facts(H200, plan, facts[:1])

"""Seed 000's tables, reproduced through e-graph -> extraction -> cost."""

import pytest

from planner.core.cost import load_device
from planner.core.examples import ew_chain, heavy, mlp_epilogue
from planner.egraph.candidates import build_candidates


def _by_partition(cands, custom_only=True):
    out = {}
    for p in cands.plans:
        if custom_only and any(k.kind == "cublaslt" for k in p.kernels):
            continue
        out[p.partition] = p
    return out


def test_mlp_epilogue_4096_tables():
    cands = build_candidates(mlp_epilogue(4096, 4096, 4096, "fp16"), load_device("seed-k4"))
    custom = _by_partition(cands)
    assert len(custom) == 8
    assert sum(1 for p in cands.plans if all(k.kind != "cublaslt" for k in p.kernels)) == 8
    expected = {
        (1, 1, 1, 1): (335_552_512, 4, 128),
        (1, 3): (201_334_784, 2, 128),
        (2, 2): (201_334_784, 2, 136),
        (4,): (134_225_920, 1, 160),
    }
    for part, (nbytes, launches, regs) in expected.items():
        p = custom[part]
        assert (p.bytes, p.launches, p.reg_peak) == (nbytes, launches, regs), part
    assert custom[(4,)].est_us == pytest.approx(3450, rel=0.01)
    best_custom = min(custom.values(), key=lambda p: p.sort_key())
    assert best_custom.partition == (4,)
    assert cands.best.partition == (4,)
    # cuBLASLt variants are listed with their partitions
    lt = {(p.partition, p.kernels[0].epilogue) for p in cands.plans if p.kernels[0].kind == "cublaslt"}
    assert ((3, 1), "GELU_BIAS") in lt and ((2, 2), "BIAS") in lt and ((1, 3), "DEFAULT") in lt
    assert len(cands.plans) == 15


def test_decode_shape():
    cands = build_candidates(mlp_epilogue(16, 4096, 4096, "fp16"), load_device("seed-k4"))
    custom = _by_partition(cands)
    assert custom[(1, 1, 1, 1)].est_us == pytest.approx(97.5, rel=0.01)
    assert custom[(4,)].est_us == pytest.approx(80.8, rel=0.01)
    assert cands.best.partition == (4,)


def test_heavy_fusion_loses():
    cands = build_candidates(heavy(), load_device("seed-k4"))
    parts = _by_partition(cands)
    assert parts[(1, 1)].est_us == pytest.approx(1210, rel=0.01)
    assert 1800 * 0.99 <= parts[(2,)].est_us <= 1810 * 1.01
    assert parts[(2,)].kernels[0].cost.spills
    assert cands.best.partition == (1, 1)


def test_ew_chain_every_partition():
    g = ew_chain(8, 2**24)
    m = len(g.ops)
    assert m == 12
    cands = build_candidates(g, load_device("seed-k4"))
    parts = {p.partition for p in cands.plans}
    assert len(parts) == len(cands.plans) == 2 ** (m - 1)
    naive_stage_plan = (2, 1, 2, 1, 2, 1, 2, 1)  # one kernel per seed stage (affine+relu on even s)
    assert naive_stage_plan in parts and (12,) in parts and (1,) * 12 in parts


def test_erf_gelu_never_becomes_cublaslt_gelu():
    cands = build_candidates(mlp_epilogue(64, 64, 64, "fp16", gelu="erf"), load_device("seed-k4"))
    epilogues = {k.epilogue for p in cands.plans for k in p.kernels if k.kind == "cublaslt"}
    assert epilogues == {"DEFAULT", "BIAS"}
    assert len(cands.plans) == 14

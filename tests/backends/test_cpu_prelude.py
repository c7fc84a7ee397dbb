"""The C prelude's vector helpers where the target has AVX2 but not AVX-512 (the AMD EPYC machines of this kind):
8-lane row partials and attention blocks.  Compiled so (``-mno-avx512f`` after ``-march=native``) on any x86
machine, every fused row kernel and attention kernel that uses them equals the unfused graph's numpy semantics."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from backends.cpu import compiler, gemm
from backends.cpu.backend import CpuBackend
from backends.cpu.prelude import PRELUDE
from planner.core import examples
from planner.core.cost import load_device
from planner.core.graph import Graph, GraphBuilder
from planner.core.machine import ISA_ENV
from planner.core.reference import execute_graph, random_inputs
from planner.egraph.candidates import build_candidates

SPEC = load_device("h200")

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 compiler flags")


@pytest.fixture(params=["native", "avx2"])
def target(request, monkeypatch, tmp_path) -> compiler.Compiler:
    """A compiler for this CPU, or for it without AVX-512 (into a kernel cache of its own)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return compiler.Compiler(target=("-mno-avx512f",) if request.param == "avx2" else ())


def test_the_avx2_target_takes_the_preludes_8_lane_branch(target) -> None:
    source = PRELUDE + "int fp_lanes(void) { return FP_VL; }\n"
    lanes = ctypes.CDLL(str(target.build(source))).fp_lanes()
    assert lanes == 8 if target.target else lanes in (8, 16)


def test_the_isa_variable_narrows_every_compiler_and_its_16_bit_products(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(ISA_ENV, "avx2")
    narrowed = compiler.Compiler()
    assert narrowed.target == ("-mno-avx512f",) and narrowed.flags[-1] == "-mno-avx512f"
    assert not any(gemm.native_16bit(dtype) for dtype in gemm.DTYPES_16BIT)
    source = PRELUDE + "int fp_lanes(void) { return FP_VL; }\n"
    assert ctypes.CDLL(str(narrowed.build(source))).fp_lanes() == 8
    monkeypatch.setenv(ISA_ENV, "native")
    assert compiler.Compiler().target == () and compiler.Compiler().key(source) != narrowed.key(source)


def _fused(graph: Graph):  # the plan with the fewest kernels: the row op, or the attention, in one kernel
    return min(build_candidates(graph, SPEC).plans, key=lambda p: (len(p.kernels), p.sort_key()))


@pytest.mark.parametrize("graph", [
    examples.softmax(37, 128), examples.softmax(5, 200),  # a row of vectors; a ragged tail after 12 blocks of 16
    examples.layer_norm(9, 768), examples.rms_norm(7, 96, "fp32"),
], ids=["softmax-128", "softmax-200", "layernorm", "rmsnorm"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_row_kernels_equal_the_unfused_graph(graph, threads, target) -> None:
    plan = _fused(graph)
    assert len(plan.kernels) == 1
    inputs = random_inputs(graph, seed=3)
    got = CpuBackend(SPEC, threads=threads, compiler=target).compile(plan).run(inputs)
    want = execute_graph(graph, inputs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(("seq", "form"), [(70, {"causal": False}), (70, {"causal": True}), (130, {"causal": True}),
                                         (9, {"causal": False}), (70, {"masked": True}), (45, {"biased": True})])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_fused_attention_equals_the_unfused_graph(seq, form, threads, target) -> None:
    graph = examples.attention(2, seq, 96, 3, "fp32", **form)
    plan = _fused(graph)
    assert any(k.describe().endswith("Attention]") for k in plan.kernels)
    inputs = random_inputs(graph, seed=4)
    got = CpuBackend(SPEC, threads=threads, compiler=target).compile(plan).run(inputs)
    want = execute_graph(graph, inputs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("shape", [(3, 8), (3, 37), (1, 1 << 16)], ids=["rows", "blocks-of-16", "streaming"])
def test_relu_in_a_fused_chain_keeps_nan_and_negative_zero_bit_for_bit(shape, target) -> None:
    """``fp_relu`` is x86's max(zero, x) with a zero gcc cannot fold: NaN and -0 pass through, negatives become +0,
    in the plain loop, the overlapping blocks of 16 and the streaming loop, with either target's vectors."""
    b = GraphBuilder("relu-bits")
    b.input("x", shape, "fp32")
    b.input("s", shape, "fp32")
    g = b.build([b.op("y", "Relu", [b.op("m", "Mul", ["x", "s"])])])
    plan = _fused(g)
    assert len(plan.kernels) == 1
    special = np.array([np.nan, -np.nan, -0.0, 0.0, -1.5, 2.5, -np.inf, np.inf, -1e-45, 1e-45], dtype=np.float32)
    x = np.resize(special, shape).astype(np.float32)
    inputs = {"x": x, "s": np.ones(shape, dtype=np.float32)}
    streams = shape[0] == 1
    backend = CpuBackend(SPEC, threads=1, compiler=target, stream_bytes=1 if streams else 1 << 40)
    compiled = backend.compile(plan)
    assert compiled.kernel_facts[0]["streaming_stores"] == streams
    got = compiled.run(inputs)[0]
    want = np.where(x < 0, np.float32(0), x)  # NaN and -0 compare false: kept as they are
    quiet = np.uint32(0xFFBFFFFF)  # every bit but NaN's quiet bit, which a vector op may set
    np.testing.assert_array_equal(got.view(np.uint32) & quiet, want.view(np.uint32) & quiet)
    np.testing.assert_array_equal(got, execute_graph(g, inputs)[0])


def _one_kernel(g: Graph, inputs: dict[str, np.ndarray], target: compiler.Compiler) -> np.ndarray:
    plan = _fused(g)
    assert len(plan.kernels) == 1
    return CpuBackend(SPEC, threads=1, compiler=target, stream_bytes=1 << 40).compile(plan).run(inputs)[0]


def _exp_of(x: np.ndarray, target: compiler.Compiler) -> np.ndarray:
    b = GraphBuilder("exp")
    b.input("x", x.shape, "fp32")
    return _one_kernel(b.build([b.op("y", "Exp", ["x"])]), {"x": x}, target)


EXP_EDGES = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.72283, 88.7229, 89.5, -87.33, -103.972, -103.98, -200.0],
                     dtype=np.float32)


def _assert_exp_close(x: np.ndarray, got: np.ndarray) -> None:
    """Within an ulp of fp64 exp where the result is normal, within one subnormal step elsewhere, NaN kept."""
    with np.errstate(over="ignore"):
        want64 = np.exp(x.astype(np.float64))
        want = want64.astype(np.float32)
    normal = np.isfinite(want) & (np.abs(want) >= np.finfo(np.float32).tiny)
    ulps = np.abs(got[normal] - want64[normal]) / np.spacing(want[normal]).astype(np.float64)
    assert ulps.max() <= 1.0, f"{ulps.max():.2f} ulp at x = {x[normal][ulps.argmax()]}"
    rest = ~normal
    np.testing.assert_allclose(got[rest], want[rest], rtol=0, atol=np.float32(1.5e-45))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(x))


def test_exp_is_within_an_ulp_of_fp64_and_exact_at_the_edges(target) -> None:
    """``fp_exp`` (the vector forms gcc calls, and the scalar one of a loop's remainder): within an ulp of fp64 exp
    over fp32's range, inf past FLT_MAX, subnormals below the normal range (rounded once: within one subnormal
    step), 0 from about -104, NaN kept."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-110, 95, 50_000), np.linspace(-105, -86, 5_000), np.linspace(86, 90, 2_000),
                        rng.uniform(-1, 1, 5_000), EXP_EDGES]).astype(np.float32)
    got = _exp_of(x, target)
    _assert_exp_close(x, got)
    assert got[-len(EXP_EDGES):][1:4].tolist() == [np.inf, 0.0, 1.0] and got[-len(EXP_EDGES):][-2:].tolist() == [0, 0]


def test_exp_of_masked_lanes_is_0_beside_exact_lanes(target) -> None:
    """A masked score's lanes (-inf, torch's finfo.min mask, anything at or below -104) are 0, and the lanes beside
    them in the same vector exact, whether or not another lane there needs the clamped form (a subnormal or an
    infinite result, a NaN): AVX2's form zeroes such lanes in line."""
    rng = np.random.default_rng(8)
    x = rng.uniform(-80, 80, (256, 16)).astype(np.float32)
    masked = rng.random(x.shape) < 0.3
    x[masked] = rng.choice(np.array([-np.inf, np.finfo(np.float32).min, -104.0, -150.0], np.float32), masked.sum())
    x[::3, 7] = rng.choice(np.array([-95.0, -103.98, 88.75, np.nan], np.float32), x[::3].shape[0])
    x = x.ravel()
    got = _exp_of(x, target)
    _assert_exp_close(x, got)
    np.testing.assert_array_equal(got[x <= -104], 0.0)


def test_exp_gives_a_value_the_same_bits_in_every_lane(target) -> None:
    """The vector forms (16 or 8 lanes, a 4-lane one) and the scalar remainder compute alike: the same values at
    every offset give the same bits."""
    x = np.random.default_rng(6).uniform(-106, 90, 4_099).astype(np.float32)
    x[::97] = EXP_EDGES[np.arange(x[::97].size) % len(EXP_EDGES)]
    first = _exp_of(x, target)
    for shift in (1, 5, 9):
        moved = _exp_of(np.concatenate([np.zeros(shift, np.float32), x]), target)[shift:]
        np.testing.assert_array_equal(moved.view(np.uint32) | np.uint32(0x400000) * np.isnan(moved),
                                      first.view(np.uint32) | np.uint32(0x400000) * np.isnan(first))


@pytest.mark.parametrize("width", [128, 200])
def test_a_row_maximum_is_nan_exactly_where_its_row_holds_one(width, target) -> None:
    """The row maximum runs through x86's max, which drops a NaN operand; the lanes that read one are marked beside
    it: a NaN at any column (every lane of the vectors, and the tail past the last vector of 16) makes the row's
    maximum NaN, and only that row's; infinities stay the maximum."""
    rows = width + 3
    x = np.random.default_rng(7).standard_normal((rows, width)).astype(np.float32)
    x[np.arange(width), np.arange(width)] = np.nan  # row i: NaN at column i
    x[width, 5], x[width + 1, :] = np.inf, -np.inf
    b = GraphBuilder("row-max")
    b.input("x", (rows, width), "fp32")
    got = _one_kernel(b.build([b.op("m", "RowMax", ["x"])]), {"x": x}, target)
    np.testing.assert_array_equal(got[:, 0], np.max(x, axis=-1))

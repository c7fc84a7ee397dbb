"""Winograd's F(4x4, 3x3) convolution on the CPU: its transforms are the correlation exactly, its kernels equal
the direct convolution within a fraction of fp32's tolerance on awkward shapes and across threads, it is used
only where it applies and was measured faster, and a plan using it equals the reference."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from backends.cpu import parallel, winograd
from backends.cpu.backend import CpuBackend
from backends.cpu.compiler import ISA_FLAGS, Compiler
from backends.cpu.memory import from_storage, to_storage
from planner.core import examples
from planner.core.cost import load_device
from planner.core.errors import UsageError
from planner.core.machine import target_isa
from planner.core.ops import OPS
from planner.core.reference import execute_plan, random_inputs
from planner.core.tolerance import TOLERANCES
from planner.egraph.candidates import build_candidates

torch = pytest.importorskip("torch")

#: the code of the ISA the suite does not run (AVX2 where it runs native code, else native): another
#: contender, whose measured choices are recorded apart
OTHER_CODE = ISA_FLAGS["native" if target_isa() == "avx2" else "avx2"]
SPEC = load_device("h200")
IMPL = "winograd-f4x4-fp32-conv+c-epilogue"


def _window(h: int, w: int, ph: int = 1, pw: int = 1, **other: int) -> dict[str, int]:
    return {"height": h, "width": w, "kh": 3, "kw": 3, "sh": 1, "sw": 1, "ph": ph, "pw": pw, "dh": 1, "dw": 1,
            **other}


def _exact(m: np.ndarray) -> list[list[Fraction]]:
    """The matrix's entries as the fractions they round (1/3, 1/15, ... are not binary fractions)."""
    return [[Fraction(float(v)).limit_denominator(1000) for v in row] for row in m]


def test_the_transforms_are_the_correlation_exactly() -> None:
    """``Aᵀ[(G g) ⊙ (Bᵀ d)]`` is the correlation of 6 inputs with 3 taps for every d and g: the identity holds
    entry by entry in exact arithmetic (each output's coefficient of g_k d_l is 1 where l = i + k, else 0), and
    the fp64 constants are those fractions rounded."""
    a_t, g, b_t = _exact(winograd.A_T), _exact(winograd.G), _exact(winograd.B_T)
    for i in range(winograd.TILE):
        for k in range(3):
            for ell in range(winograd.ALPHA):
                coefficient = sum(a_t[i][j] * g[j][k] * b_t[j][ell] for j in range(winograd.ALPHA))
                assert coefficient == (1 if ell == i + k else 0), (i, k, ell)
    for exact, rounded in ((a_t, winograd.A_T), (g, winograd.G), (b_t, winograd.B_T)):
        assert np.array_equal(np.array(exact, dtype=np.float64), rounded)


def _direct(x: np.ndarray, w: np.ndarray, images: int, window: dict[str, int]) -> np.ndarray:
    """The convolution in fp64, as torch computes it."""
    h, wd, c, o = window["height"], window["width"], x.shape[1], w.shape[1]
    xs = torch.tensor(x, dtype=torch.float64).view(images, h, wd, c).permute(0, 3, 1, 2)
    ws = torch.tensor(w, dtype=torch.float64).view(3, 3, c, o).permute(3, 2, 0, 1)
    y = torch.nn.functional.conv2d(xs, ws, None, 1, (window["ph"], window["pw"]))
    return y.permute(0, 2, 3, 1).reshape(-1, o).numpy()


def _tolerance_used(got: np.ndarray, want: np.ndarray) -> float:
    """The largest error as a share of what fp32's tolerance allows that element."""
    rtol, atol = TOLERANCES["fp32"]
    return float((np.abs(got - want) / (atol * np.abs(want).max() + rtol * np.abs(want))).max())


@pytest.mark.parametrize(("threads", "block"), [(1, None), (2, None), (1, 7), (2, 16)])
@pytest.mark.parametrize(("images", "channels", "outputs", "h", "w", "ph", "pw"), [
    (1, 64, 64, 20, 20, 1, 1),  # whole tiles, whole vectors
    (2, 17, 33, 13, 11, 1, 1),  # a channel and an output past a vector, tiles cut at the image's edge
    (1, 16, 16, 6, 9, 0, 0),  # no padding: 4x7 outputs
    (3, 24, 20, 5, 7, 2, 1),  # the widest padding a tile takes, unequal
    (1, 128, 96, 8, 8, 1, 1),
])
def test_the_kernels_equal_the_direct_convolution(images, channels, outputs, h, w, ph, pw, threads, block) -> None:
    """In one block of every tile or in blocks (7: the last one ends past the last tile), one thread or two."""
    window = _window(h, w, ph, pw)
    rng = np.random.default_rng(images * 1000 + channels)
    x = rng.standard_normal((images * h * w, channels), dtype=np.float32)
    weight = (rng.standard_normal((9 * channels, outputs)) / np.sqrt(9 * channels)).astype(np.float32)
    conv = winograd.winograd_conv(window, images, channels, outputs, Compiler().function,
                                  parallel.WorkerPool(threads), threads, block=block)
    want = _direct(x, weight, images, window)
    got = conv(x, weight)
    assert got.shape == want.shape == (OPS["Im2col"].evaluate([x], window).shape[0], outputs)
    assert _tolerance_used(got, want) < 0.5
    assert conv(2 * x, weight) is got and _tolerance_used(got, 2 * want) < 0.5  # its own array, reused


@pytest.mark.parametrize(("tiles", "channels", "budget", "want"), [
    (196, 64, 1 << 20, 49),  # 4 even blocks of 36 x 49 x 128 fp32 values
    (196, 64, 1 << 30, 196),  # all in one
    (128, 32, 1 << 20, 64),
    (20, 256, 1 << 20, 20),  # fewer than 2 x MIN_BLOCK tiles: one block however large
    (100, 256, 1 << 16, 17),  # 6 blocks of at least MIN_BLOCK, not the 73 the budget asks for
])
def test_blocks_fit_the_budget_evenly_with_enough_rows(tiles, channels, budget, want) -> None:
    block = winograd.block_tiles(tiles, channels, channels, budget)
    assert block == want
    assert block >= min(tiles, winograd.MIN_BLOCK)


def test_blocks_grow_with_the_threads_that_split_them(monkeypatch) -> None:
    monkeypatch.setattr(winograd, "cache_levels", lambda: {1: 32 << 10, 2: 1 << 20})
    assert [winograd.block_tiles(196, 64, 64, threads=t) for t in (1, 2)] == [49, 196]
    monkeypatch.setattr(winograd, "cache_levels", dict)  # no L2 reported: DEFAULT_BLOCK_BYTES
    assert winograd.block_tiles(196, 64, 64) == 49


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16bit_operands_are_transformed_and_multiplied_in_fp32(dtype) -> None:
    """The stored 16-bit values, exactly as the direct convolution of those values computes them (to fp32's
    tolerance, far inside the 16-bit one)."""
    window, images, channels, outputs = _window(9, 7), 2, 20, 18
    rng = np.random.default_rng(7)
    x = np.empty((images * 63, channels), np.uint16)
    weight = np.empty((9 * channels, outputs), np.uint16)
    to_storage(rng.standard_normal(x.shape, dtype=np.float32), dtype, x)
    to_storage(rng.standard_normal(weight.shape, dtype=np.float32) / 12, dtype, weight)
    conv = winograd.winograd_conv(window, images, channels, outputs, Compiler().function, parallel.WorkerPool(1), 1,
                                  dtype)
    got = conv(x, weight)
    assert got.dtype == np.float32
    assert _tolerance_used(got, _direct(from_storage(x, dtype), from_storage(weight, dtype), images, window)) < 0.5


def test_a_read_only_weight_is_transformed_once_and_a_writable_one_every_call(monkeypatch) -> None:
    window = _window(8, 8)
    conv = winograd.winograd_conv(window, 1, 16, 16, Compiler().function, parallel.WorkerPool(1), 1)
    transforms = []
    real = winograd.weight_transform
    monkeypatch.setattr(winograd, "weight_transform", lambda w, c, d: transforms.append(1) or real(w, c, d))
    x = np.ones((64, 16), np.float32)
    weight = np.full((144, 16), 0.5, np.float32)
    conv(x, weight)
    weight[:] = 0.25  # written in place between calls: seen
    np.testing.assert_allclose(conv(x, weight), _direct(x, weight, 1, window), rtol=1e-5)
    weight.flags.writeable = False
    conv(x, weight)
    conv(x, weight)
    assert len(transforms) == 3


@pytest.mark.parametrize(("window", "channels", "outputs"), [
    (_window(8, 8, sh=2, sw=2), 16, 16),  # stride 2
    (_window(8, 8, dh=2, dw=2), 16, 16),  # dilated
    (_window(8, 8, kh=5, kw=5), 16, 16),  # 5x5
    (_window(8, 8, ph=3), 16, 16),  # padding past a tile's reach
    (_window(8, 8), 8, 16),  # too few channels in
    (_window(8, 8), 16, 8),  # too few out
])
def test_it_applies_only_to_3x3_windows_of_stride_and_dilation_1(window, channels, outputs) -> None:
    assert winograd.applies(_window(8, 8), 16, 16)
    assert not winograd.applies(window, channels, outputs)


def _block_plan(dtype: str = "fp32"):
    """ResNet's basic block (2 images, 16 channels, 10x10) and its unfused plan."""
    graph = examples.conv_block(2, 16, 10, dtype)
    return graph, build_candidates(graph, SPEC).unfused


def _impls(backend: CpuBackend, plan) -> list[str]:
    return [str(f.get("impl")) for f in backend.compile(plan).kernel_facts]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_plan_with_winograd_convolutions_equals_the_reference(threads, monkeypatch) -> None:
    monkeypatch.setenv(winograd.CONVOLUTION_ENV, "winograd")
    graph, plan = _block_plan()
    compiled = CpuBackend(SPEC, threads=threads).compile(plan)
    assert [f.get("impl") for f in compiled.kernel_facts].count(IMPL) == 2
    inputs = random_inputs(graph, seed=3)
    for got, want in zip(compiled.run(inputs), execute_plan(plan, inputs), strict=True):
        assert _tolerance_used(got, want) < 0.5


@pytest.mark.parametrize(("winograd_ms", "onednn_ms", "chosen"), [(1.0, 2.0, "winograd"), (1.0, 1.02, "onednn")])
def test_the_choice_is_measured_once_per_shape_and_recorded(winograd_ms, onednn_ms, chosen, tmp_path,
                                                            monkeypatch) -> None:
    """``auto`` times both products once per shape and backend (Winograd's must win by the margin), and records
    the choice in the kernel cache for the next process; a forced choice is taken as it is; a bad value is
    refused."""
    from backends.cpu.steps import GemmSteps

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(winograd.CONVOLUTION_ENV, "auto")
    timed: list[tuple[int, ...]] = []

    def fake_time(self, window, images, channels, outputs, dtype):
        timed.append((images, channels, outputs))
        return {"winograd": winograd_ms / 1e3, "onednn": onednn_ms / 1e3}

    monkeypatch.setattr(GemmSteps, "_time_convolution", fake_time)
    _, plan = _block_plan()
    for _ in range(2):
        backend = CpuBackend(SPEC, threads=1)
        for _ in range(2):
            impls = _impls(backend, plan)
            assert impls.count(IMPL) == (2 if chosen == "winograd" else 0)
    assert timed == [(2, 16, 16)] and list(tmp_path.rglob("convolution-*.json"))  # both convolutions: one shape
    _impls(CpuBackend(SPEC, threads=1, compiler=Compiler(target=OTHER_CODE)), plan)
    assert len(timed) == 2  # the other ISA's code: another contender, measured again
    monkeypatch.setenv(winograd.CONVOLUTION_ENV, "onednn" if chosen == "winograd" else "winograd")
    assert _impls(CpuBackend(SPEC, threads=1), plan).count(IMPL) == (0 if chosen == "winograd" else 2)
    assert len(timed) == 2
    monkeypatch.setenv(winograd.CONVOLUTION_ENV, "fastest")
    with pytest.raises(UsageError, match=winograd.CONVOLUTION_ENV):
        CpuBackend(SPEC, threads=1).compile(plan)


def test_the_timing_runs_both_products_on_the_backends_threads() -> None:
    seconds = CpuBackend(SPEC, threads=2)._time_convolution(_window(12, 12), 2, 16, 24)
    assert set(seconds) == {"winograd", "onednn"} and all(0 < s < 1 for s in seconds.values())


@pytest.mark.parametrize(("mode", "dtype"), [("auto", "fp32"), ("winograd", "fp32"), ("onednn", "fp32"),
                                             ("winograd", "bf16")])
def test_prepare_builds_the_transforms_a_compile_loads(mode, dtype, tmp_path, monkeypatch) -> None:
    """A search's batched compiler runs build each convolution's transforms and epilogue (what the measured choice
    times and the Winograd step loads; a 16-bit one's epilogue reads fp32 rows), so compiling the plan builds
    nothing more; no transforms where oneDNN's is forced."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(winograd.CONVOLUTION_ENV, mode)
    _, plan = _block_plan(dtype)
    compiler = Compiler()
    backend = CpuBackend(SPEC, compiler=compiler, threads=1)
    backend.prepare([plan])
    built = compiler.compiled
    impls = _impls(backend, plan)
    assert compiler.compiled == built
    assert any(i.startswith("winograd-") for i in impls) == (mode == "winograd") or mode == "auto"
    assert bool(backend._winograd_sources(plan)) == (mode != "onednn")

"""The cuBLASLt call's side of the nvmath-python contract, on the CPU: a stand-in ``Matmul`` records what the
executor asks of it (cupy must import, as with the ``test`` extra; no GPU is used)."""

import sys
import types

import numpy as np
import pytest

from backends.cupy.bundle import CublasCall

pytestmark = pytest.mark.nvrtc  # needs cupy importable, which the nvrtc extra brings


class FakeMatmul:
    """nvmath.linalg.advanced.Matmul on numpy arrays: alpha a @ b + beta c, in place into c when asked."""

    made: list["FakeMatmul"] = []
    refuse_inplace = False

    def __init__(self, a, b, c=None, *, beta=None, options=None, stream=None):
        self.inplace = bool((options or {}).get("inplace"))
        if self.inplace and FakeMatmul.refuse_inplace:
            raise ValueError("in-place result not supported here")
        self.a, self.b, self.c, self.beta = a, b, c, beta
        FakeMatmul.made.append(self)

    def plan(self, epilog=None, epilog_inputs=None, stream=None):
        self.epilog, self.bias = epilog, (epilog_inputs or {}).get("bias")

    def execute(self, stream=None):
        r = self.a @ self.b
        if self.bias is not None:
            r = r + self.bias  # a column: one entry per row of the (column-major) result
        if self.epilog == "RELU_BIAS":
            r = np.maximum(r, 0)
        if self.inplace:
            self.c[...] = r
            return self.c
        return np.asfortranarray(r)

    def free(self):
        pass


@pytest.fixture
def gpu(monkeypatch):
    from backends.cupy import gpu

    advanced = types.ModuleType("nvmath.linalg.advanced")
    advanced.Matmul = FakeMatmul
    advanced.MatmulEpilog = {"BIAS": "BIAS", "RELU_BIAS": "RELU_BIAS"}
    for name, mod in {"nvmath": types.ModuleType("nvmath"), "nvmath.linalg": types.ModuleType("nvmath.linalg"),
                      "nvmath.linalg.advanced": advanced}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    FakeMatmul.made, FakeMatmul.refuse_inplace = [], False
    return gpu


def _bufs():
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((5, 3)).astype(np.float32), "b": rng.standard_normal((3, 4)).astype(np.float32),
            "bias": rng.standard_normal(4).astype(np.float32), "out": np.zeros((5, 4), np.float32)}


def test_the_result_is_written_in_place_into_the_plans_own_buffer(gpu):
    bufs = _bufs()
    out = bufs["out"]
    g = gpu.CublasLtGemm(CublasCall("a", "b", "bias", "RELU_BIAS", 5, 4, 3, "fp32"), bufs, "out", stream=None)
    (mm,) = FakeMatmul.made
    assert g.preallocated and mm.inplace and mm.beta == 0.0
    assert mm.c.base is out and mm.c.shape == (4, 5)  # D^T as a free view of the row-major D
    assert g() is out and bufs["out"] is out
    np.testing.assert_allclose(out, np.maximum(bufs["a"] @ bufs["b"] + bufs["bias"], 0), rtol=1e-6)


def test_a_library_refusing_the_in_place_form_still_gives_the_result_and_says_so(gpu, caplog):
    FakeMatmul.refuse_inplace = True
    bufs = _bufs()
    g = gpu.CublasLtGemm(CublasCall("a", "b", "bias", "BIAS", 5, 4, 3, "fp32"), bufs, "out", stream=None)
    assert not g.preallocated and "no in-place result" in caplog.text
    r = g()
    assert r.flags.c_contiguous and not g.layout_copy  # column-major D^T is row-major D: no copy
    np.testing.assert_allclose(r, bufs["a"] @ bufs["b"] + bufs["bias"], rtol=1e-6)


def test_a_plan_the_library_cannot_free_is_logged_and_the_run_goes_on(gpu, caplog, monkeypatch):
    bufs = _bufs()
    g = gpu.CublasLtGemm(CublasCall("a", "b", "bias", "BIAS", 5, 4, 3, "fp32"), bufs, "out", stream=None)

    def refuse():
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(g.mm, "free", refuse)
    g.close()
    assert "cuBLASLt BIAS plan not freed (CUDA_ERROR_INVALID_VALUE)" in caplog.text

import numpy as np
import pytest

from planner.core.cost import load_device
from planner.core.dtypes import round_to
from planner.core.tolerance import TOLERANCES, allclose_report, tolerance


def test_every_storage_dtype_has_a_tolerance_and_they_order_by_precision():
    for dtype in ("fp32", "fp16", "bf16", "fp64"):
        rtol, atol = tolerance(dtype)
        assert 0 < rtol < 0.1 and 0 < atol < 0.1
    assert tolerance("fp64")[0] < tolerance("fp32")[0] < tolerance("fp16")[0] < tolerance("bf16")[0]
    with pytest.raises(ValueError, match="int8"):
        tolerance("int8")
    assert set(TOLERANCES) == {"fp32", "fp16", "bf16", "fp64"}


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_one_rounding_passes_and_a_real_difference_fails(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32) * 10
    ok, max_abs, max_rel = allclose_report(round_to(x, dtype), x, dtype)
    assert ok and max_abs > 0 or dtype == "fp32"
    y = x.copy()
    bump = 0.2 * float(np.abs(x).max())  # beyond atol*scale + rtol*|x| for every dtype
    y[17] += bump
    ok, max_abs, _ = allclose_report(y, x, dtype)
    assert not ok and max_abs == pytest.approx(bump, rel=1e-5)


def test_nan_and_inf_must_match():
    e = np.array([1.0, np.nan, np.inf, -np.inf])
    assert allclose_report(e.copy(), e, "fp32")[0]
    for bad in ([1.0, 0.0, np.inf, -np.inf], [1.0, np.nan, -np.inf, -np.inf], [np.nan, np.nan, np.inf, -np.inf]):
        ok, max_abs, max_rel = allclose_report(np.array(bad), e, "fp16")
        assert (ok, max_abs, max_rel) == (False, float("inf"), float("inf"))


def test_atol_is_relative_to_the_magnitude_scale():
    # cancellation: an element near zero next to large ones is judged against the tensor's magnitude
    e = np.array([1000.0, 0.0])
    a = np.array([1000.0, 0.5])
    assert allclose_report(a, e, "fp16")[0]
    assert not allclose_report(a, e, "fp16", scale=1.0)[0]
    assert allclose_report(a, e, "fp16", scale=1.0, extra_atol=0.5)[0]


def test_shape_mismatch_is_not_close():
    assert allclose_report(np.zeros(3), np.zeros(4), "fp32") == (False, float("inf"), float("inf"))


def test_a_non_finite_reference_on_finite_inputs_verifies_nothing():
    from planner.core.examples import ew_chain
    from planner.core.tolerance import check_outputs
    from planner.egraph.candidates import build_candidates

    graph = ew_chain(2, 8)
    plan = build_candidates(graph, load_device("h200")).unfused
    ref = np.full(8, np.inf, dtype=np.float32)
    reason, _, _ = check_outputs(plan, [ref.copy()], [ref])
    assert reason is not None and "NaN or infinite on finite inputs" in reason and "overflows" in reason
    # with non-finite inputs a non-finite reference is legitimate: then it must match exactly
    assert check_outputs(plan, [ref.copy()], [ref], finite_inputs=False)[0] is None

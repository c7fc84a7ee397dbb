"""PlanResult.check: a chosen plan that differs from eager torch is an error that says where the difference
comes from (its kernels' determinism, the numpy reference of its kernels on the same inputs) and names the plan."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import planner  # noqa: E402
from planner.api import PlanMismatchError, PlanResult  # noqa: E402
from planner.core.reference import execute_plan  # noqa: E402


def _planned() -> tuple[PlanResult, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.GELU()).eval()
    x = torch.randn(4, 16)
    return planner.plan(module, x, backend="reference", cache=False, on_change=None), module, x


def _runner_adding(result: PlanResult, shift: object) -> None:
    """Make ``result`` run the numpy reference of its plan, ``shift()`` added to every output."""
    def run(feed, hand_out, early):
        return hand_out([o + shift() for o in execute_plan(result.plan, feed, mode="device")])

    result._runner = run


def test_a_plan_whose_kernels_compute_wrong_values_is_refused_naming_the_backend_and_the_plan() -> None:
    result, module, x = _planned()
    _runner_adding(result, lambda: np.float32(1.0))
    with torch.no_grad(), pytest.raises(PlanMismatchError) as caught:
        result.check(module(x), x)
    said = str(caught.value)
    assert "a second run differs from the first by max abs 0;" in said
    assert "agrees with eager torch" in said and "the backend computed them wrong" in said
    assert result.plan.notation() in said


def test_a_plan_whose_kernels_are_not_deterministic_is_refused_saying_so() -> None:
    result, module, x = _planned()
    rng = np.random.default_rng(0)
    _runner_adding(result, lambda: rng.standard_normal(1).astype(np.float32))
    with torch.no_grad(), pytest.raises(PlanMismatchError, match="its kernels are not deterministic"):
        result.check(module(x), x)


def test_an_expected_value_no_kernel_reference_reaches_blames_the_plan_or_the_import() -> None:
    result, module, x = _planned()
    with torch.no_grad():
        expected = module(x) + 1
    with pytest.raises(PlanMismatchError, match="differs from eager torch .*the plan or the import is wrong"):
        result.check(expected, x)
    with torch.no_grad():
        assert result.check(module(x), x)[0][0] < 1e-5

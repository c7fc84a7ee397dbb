"""The numpy reference executor: inputs rounded to their dtype once, by the recipe or on the way in."""

from __future__ import annotations

import numpy as np
import pytest

from planner.core.dtypes import round_to
from planner.core.examples import mlp_epilogue
from planner.core.inputs import RecipeInputs, random_inputs
from planner.core.reference import execute_graph, prepare_inputs


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_recipe_inputs_are_not_rounded_again_and_give_the_same_outputs(dtype: str) -> None:
    g = mlp_epilogue(16, 24, 32, dtype, "tanh")
    drawn = random_inputs(g, 3)
    assert isinstance(drawn, RecipeInputs)
    tensors = {n.id: n.type for n in g.nodes}
    names = [n.id for n in g.inputs]
    for mode in ("device", "oracle"):
        fast, full = prepare_inputs(tensors, drawn, names, mode), prepare_inputs(tensors, dict(drawn), names, mode)
        for name in names:
            np.testing.assert_array_equal(fast[name], full[name])
            assert fast[name].dtype == full[name].dtype
        for a, b in zip(execute_graph(g, drawn, mode), execute_graph(g, dict(drawn), mode), strict=True):
            np.testing.assert_array_equal(a, b)


def test_other_inputs_are_rounded_to_their_dtype() -> None:
    g = mlp_epilogue(16, 24, 32, "fp16", "tanh")
    x = {n.id: np.random.default_rng(0).standard_normal(n.type.shape).astype(np.float32) for n in g.inputs}
    mem = prepare_inputs({n.id: n.type for n in g.nodes}, x, list(x), "device")
    for name, arr in x.items():
        assert not np.array_equal(mem[name], arr)  # a random fp32 value is rarely an fp16 one
        np.testing.assert_array_equal(mem[name], round_to(arr, "fp16"))

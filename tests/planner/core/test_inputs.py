"""The input recipe's integer inputs: indices below the table they index, masks of 0s and 1s."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.core.graph import GraphBuilder
from planner.core.inputs import INDEX_STEP, index_rows, random_inputs


def _called_with_indices(then: list[dict]) -> GraphBuilder:
    """An Opaque torch call whose first step converts input ``a`` back to integers, then ``then``."""
    b = GraphBuilder("indices")
    b.input("a", (2, 8), "fp32")
    steps = [{"impl": INDEX_STEP, "args": [{"$in": 0}], "kwargs": {"$dict": {}}, "item": -1, "shapes": [[2, 8]],
              "out": [2, 8]}, *then]
    call = {"steps": steps, "in": [[2, 8]], "out": [2, 8]}
    b.op("y", "Opaque", ["a"], {"impl": "torch.where", "call": json.dumps(call)})
    return b


def _step(impl: str, *args: object, **kwargs: object) -> dict:
    return {"impl": impl, "args": [{"$step": 0}, *args], "kwargs": {"$dict": kwargs}, "item": -1,
            "shapes": [[2, 8]], "out": [2, 8]}


@pytest.mark.parametrize("conversion", [
    _step("torch.Tensor.to", {"$dtype": "bool"}),
    _step("torch.ops.aten.to.dtype", dtype={"$dtype": "bool"}),
], ids=["Tensor.to", "aten.to.dtype"])
def test_an_index_only_converted_to_bool_is_drawn_as_a_mask_of_0s_and_1s(conversion: dict) -> None:
    graph = _called_with_indices([conversion]).build(["y"])
    assert index_rows(graph) == {"a": 2}
    drawn = random_inputs(graph, 0)["a"]
    assert set(np.unique(drawn)) == {0.0, 1.0}  # index 0 alone would mask every position


def test_an_index_nothing_sizes_is_index_0() -> None:
    graph = _called_with_indices([_step("torch.Tensor.to", {"$dtype": "float32"})]).build(["y"])
    assert index_rows(graph) == {"a": 1}
    assert not random_inputs(graph, 0)["a"].any()

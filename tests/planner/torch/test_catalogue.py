"""The supported-ops list is made from the registries: every mapped kind says what it becomes, in op-table ops."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

from planner.core.ops import OPS  # noqa: E402
from planner.torch.catalogue import mapped_calls, supported_ops  # noqa: E402
from planner.torch.lowerings import BECOMES, LOWERINGS  # noqa: E402
from planner.torch.ops import IMPORTER_TABLE  # noqa: E402
from planner.torch.tracing import LEAF_KINDS  # noqa: E402


def test_every_mapped_kind_has_a_lowering_that_says_what_it_becomes():
    kinds = set(IMPORTER_TABLE.values()) | set(LEAF_KINDS.values())
    assert kinds <= set(LOWERINGS) and set(BECOMES) == set(LOWERINGS)
    for kind, becomes in BECOMES.items():
        named = set(re.findall(r"\b[A-Z][A-Za-z]+\b", becomes)) - {"GPT", "Conv1D", "RoPE"}
        assert named <= set(OPS), (kind, named - set(OPS))


def test_the_list_names_every_mapped_call_and_module():
    text = supported_ops()
    for kind, names in mapped_calls().items():
        assert f"  {kind}: " in text and all(name in text for name in names)
    assert "nn.Linear" in text and "torch.conv2d" in text  # a leaf module; a kept call

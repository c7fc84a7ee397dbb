"""torch.compile(backend="fusion_planner") keeps working on new shapes: each concrete shape gets its plan (up
to a limit, then eager torch), whatever torch.compile's dynamic setting, and every call equals eager torch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from planner.dynamo import MAX_PLANS  # noqa: E402

OPTIONS = {"backend": "reference"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()


def _runs(compiled, m, batches) -> None:
    with torch.no_grad():
        for b in batches:
            x = torch.randn(b, 16)
            torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dynamic", [None, True, False], ids=["default", "dynamic", "static"])
def test_three_batch_sizes_equal_eager_each_by_its_plan(dynamic, caplog):
    torch._dynamo.reset()
    m = _model()
    with caplog.at_level("INFO", logger="planner.dynamo"):
        _runs(torch.compile(m, backend="fusion_planner", dynamic=dynamic, options=OPTIONS), m, (2, 3, 5, 3))
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fusion_planner: planned")]
    assert len(planned) == 3, planned  # one plan per distinct shape: the fourth call reuses the second's
    assert not [r for r in caplog.records if "eagerly" in r.getMessage()]
    torch._dynamo.reset()


def test_mark_dynamic_equals_eager():
    torch._dynamo.reset()
    m = _model()
    compiled = torch.compile(m, backend="fusion_planner", options=OPTIONS)
    x = torch.randn(4, 16)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)
    _runs(compiled, m, (6, 7))
    torch._dynamo.reset()


def test_past_the_plan_limit_the_graph_runs_eagerly_and_says_so(caplog):
    torch._dynamo.reset()
    m = _model()
    compiled = torch.compile(m, backend="fusion_planner", dynamic=True, options=OPTIONS)
    with caplog.at_level("WARNING", logger="planner.dynamo"):
        _runs(compiled, m, range(2, 2 + MAX_PLANS + 2))
    assert any("run eagerly" in r.getMessage() for r in caplog.records)
    torch._dynamo.reset()

"""Attention's separate q, k and v projections of one input become one GEMM whose columns the head layouts read."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner
from planner.torch.importer import BoundInputs, import_module


class Attention(nn.Module):
    """LLaMA/BERT-style: three nn.Linear layers on the same rows (k and v narrower with grouped-query heads)."""

    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 4, bias: bool = False, leak: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.leak = heads, kv_heads, d // heads, leak
        self.q = nn.Linear(d, d, bias=bias)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=bias)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=bias)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k_rows = self.k(x)
        k = k_rows.view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        out = a.transpose(1, 2).reshape(b, s, -1)
        return out + k_rows.sum(-1, keepdim=True) if self.leak else out


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("bias", "kv_heads"), [(False, 4), (True, 4), (False, 2)], ids=["llama", "bert", "gqa"])
def test_projections_of_one_input_are_one_gemm_and_equal_eager(bias: bool, kv_heads: int) -> None:
    torch.manual_seed(0)
    module, x = Attention(bias=bias, kv_heads=kv_heads).eval(), torch.randn(2, 8, 32)
    imported = import_module(module, (x,))
    ops = Counter(n.op for n in imported.graph.ops)
    assert ops["MatMul"] == 1 and ops["BiasAdd"] == (1 if bias else 0) and ops["Heads"] == 3
    kv = kv_heads * 8
    assert sorted((h.attr_dict["offset"], h.attr_dict["width"]) for h in imported.graph.ops if h.op == "Heads") == [
        (0, 32), (32, kv), (32 + kv, kv)]
    packed = [b for b in imported.bindings if b.source == "packed"]
    assert [b.key for b in packed] == [("q.weight", "k.weight", "v.weight")] + (
        [("q.bias", "k.bias", "v.bias")] if bias else [])
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=4)
    with torch.no_grad():
        _close(result(x), module(x))


def test_a_changed_projection_weight_is_packed_again() -> None:
    torch.manual_seed(0)
    module, x = Attention().eval(), torch.randn(2, 8, 32)
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=2)
    with torch.no_grad():
        result(x)
        made = result.bound.conversions
        result(x)
        assert result.bound.conversions == made  # unchanged parameters: the packed weight is kept
        module.k.weight.mul_(-2.0)  # in place: torch's version counter moves
        _close(result(x), module(x))
        assert result.bound.conversions == made + 1


def test_a_projection_read_by_more_than_its_heads_stays_apart() -> None:
    torch.manual_seed(0)
    module, x = Attention(leak=True).eval(), torch.randn(2, 8, 32)
    imported = import_module(module, (x,))
    assert Counter(n.op for n in imported.graph.ops)["MatMul"] == 2  # q and v packed, k on its own
    feed = BoundInputs(imported, module).feed((x,))
    assert sorted(a.shape for name, a in feed.items() if "packed" in name) == [(32, 64)]
    result = planner.plan(module, (x,), backend="reference", cache=False)
    with torch.no_grad():
        _close(result(x), module(x))

"""Attention from torch: scaled_dot_product_attention and its head layouts import as op-table ops, plan with the
fused Attention kernel, and equal eager torch; what the mapping does not cover stays Opaque and still runs."""

from __future__ import annotations

import pytest
from testpaths import ROOT

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fusion_planner  # noqa: E402
from fusion_planner.api import allclose_report  # noqa: E402
from fusion_planner.torch.heads import HeadSplit, head_merge, head_split  # noqa: E402
from fusion_planner.torch.importer import TORCH_DTYPES, import_module, load_factory  # noqa: E402

ATTENTION_OPS = {"Heads", "BatchScores", "Affine", "RowMax", "SubRow", "Exp", "RowSum", "DivRow", "BatchApply", "Merge"}


class PackedAttention(nn.Module):
    """GPT-2's form: one qkv projection, split, view, transpose; merged with transpose + contiguous + view."""

    def __init__(self, d: int = 32, heads: int = 4, causal: bool = True, permute: bool = False) -> None:
        super().__init__()
        self.heads, self.causal, self.permute = heads, causal, permute
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        if self.permute:
            q, k, v = (t.view(b, s, self.heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        else:
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(a.transpose(1, 2).contiguous().view(b, s, d))


class SeparateAttention(nn.Module):
    """LLaMA's and BERT's form: q, k, v projections of their own, an explicit scale, reshape back."""

    def __init__(self, d: int = 32, heads: int = 2, mask: bool = False) -> None:
        super().__init__()
        self.heads, self.mask = heads, mask
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (m(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        mask = torch.ones(s, s, dtype=torch.bool).tril() if self.mask else None
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
        return a.transpose(1, 2).reshape(b, s, d)


def _close(got, want) -> None:
    ok, max_abs, max_rel = allclose_report(got.float().numpy(), want.detach().float().numpy(), TORCH_DTYPES[want.dtype])
    assert ok, (max_abs, max_rel)


def _ops(module, x):
    return [n.op for n in import_module(module, (x,)).graph.ops]


@pytest.mark.parametrize("module", [PackedAttention(), PackedAttention(causal=False, permute=True), SeparateAttention()],
                         ids=["packed-causal", "packed-permute", "separate-scaled"])
def test_sdpa_and_its_head_layouts_import_as_op_table_ops(module) -> None:
    torch.manual_seed(0)
    module.eval()
    x = torch.randn(2, 8, 32)
    ops = _ops(module, x)
    assert "Opaque" not in ops
    assert set(ops) >= ATTENTION_OPS and ops.count("Heads") == 3 and ops.count("Merge") == 1
    with torch.no_grad():
        _close(fusion_planner.plan(module, (x,), backend="reference", cache=False)(x), module(x))


def test_the_causal_flag_and_the_scale_reach_the_ops() -> None:
    graph = import_module(SeparateAttention().eval(), (torch.randn(1, 6, 32),)).graph
    (scores,) = [n for n in graph.ops if n.op == "BatchScores"]
    (scaled,) = [n for n in graph.ops if n.op == "Affine"]
    assert scores.attr_dict["causal"] == 0 and scaled.attr_dict["a"] == pytest.approx(0.3)
    packed = import_module(PackedAttention().eval(), (torch.randn(1, 6, 32),)).graph
    (scores,) = [n for n in packed.ops if n.op == "BatchScores"]
    (scaled,) = [n for n in packed.ops if n.op == "Affine"]
    assert scores.attr_dict["causal"] == 1 and scaled.attr_dict["a"] == pytest.approx(1 / 8 ** 0.5)


def test_a_masked_sdpa_stays_opaque_and_still_equals_eager() -> None:
    torch.manual_seed(0)
    module, x = SeparateAttention(mask=True).eval(), torch.randn(2, 8, 32)
    ops = _ops(module, x)
    assert "Opaque" in ops and "BatchScores" not in ops
    with torch.no_grad():
        _close(fusion_planner.plan(module, (x,), backend="reference", cache=False)(x), module(x))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_transformer_block_has_no_opaque_node_and_plans_with_fused_attention(dtype: str) -> None:
    module, (x,) = load_factory(str(ROOT / "examples/transformer_block.py:build"),
                                {"d_model": 64, "heads": 4, "seq": 16, "dtype": dtype})
    ops = _ops(module, x)
    if dtype == "fp32":
        assert "Opaque" not in ops and set(ops) >= ATTENTION_OPS
    result = fusion_planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=12)
    kernels = [k.describe() for k in result.plan.kernels]
    if dtype == "fp32":
        assert "standalone[Attention]" in kernels, kernels  # the fused kernel is the measured-better one here
        assert "standalone[BatchScores]" not in kernels
    with torch.no_grad():
        _close(result(x), module(x))


def test_head_split_reads_the_recorded_steps() -> None:
    split = {"impl": "torch.Tensor.split", "args": [{"$in": 0}, 8], "kwargs": {"$dict": {"dim": -1}}, "item": 2,
             "out": [2, 5, 8]}
    view = {"impl": "torch.Tensor.view", "args": [{"$step": 0}, 2, 5, 4, 2], "kwargs": {"$dict": {}}, "item": -1,
            "out": [2, 5, 4, 2]}
    swap = {"impl": "torch.Tensor.transpose", "args": [{"$step": 1}, 1, 2], "kwargs": {"$dict": {}}, "item": -1,
            "out": [2, 4, 5, 2]}
    assert head_split([split, view, swap], [(2, 5, 24)]) == (0, HeadSplit(heads=4, seq=5, offset=16, width=8))
    wrong_dims = {**swap, "args": [{"$step": 1}, 0, 2], "out": [4, 5, 2, 2]}
    assert head_split([split, view, wrong_dims], [(2, 5, 24)]) is None
    assert head_split([{**split, "kwargs": {"$dict": {"dim": 0}}}, view, swap], [(2, 5, 24)]) is None
    merge = {"impl": "torch.Tensor.transpose", "args": [{"$in": 0}, 1, 2], "kwargs": {"$dict": {}}, "item": -1,
             "out": [2, 5, 4, 2]}
    reshape = {"impl": "torch.Tensor.reshape", "args": [{"$step": 0}, 2, 5, 8], "kwargs": {"$dict": {}}, "item": -1,
               "out": [2, 5, 8]}
    assert head_merge([merge, reshape], [(2, 4, 5, 2)], (2, 5, 8)) == 4
    assert head_merge([merge], [(2, 4, 5, 2)], (2, 5, 4, 2)) is None  # not merged into token rows

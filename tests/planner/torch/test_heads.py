"""Attention from torch: scaled_dot_product_attention and its head layouts import as op-table ops, plan with the
fused Attention kernel, and equal eager torch; what the mapping does not cover stays Opaque and still runs."""

from __future__ import annotations

import pytest
from testpaths import ROOT

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import planner  # noqa: E402
from planner.api import allclose_report  # noqa: E402
from planner.torch.heads import HeadSplit, column_take, head_merge, head_split, rotate_half  # noqa: E402
from planner.torch.importer import TORCH_DTYPES, import_module, load_factory  # noqa: E402
from planner.torch.lowerings.layouts import causal_mask  # noqa: E402

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

    #: constant bool masks of (s, s): the causal triangle, a window of the last 3 keys, the triangle less its
    #: diagonal (the first query sees no key)
    MASKS = {"causal": lambda s: torch.ones(s, s, dtype=torch.bool).tril(),
             "window": lambda s: torch.ones(s, s, dtype=torch.bool).tril() & torch.ones(s, s, dtype=torch.bool).triu(-2),
             "hidden": lambda s: torch.ones(s, s, dtype=torch.bool).tril(-1)}

    def __init__(self, d: int = 32, heads: int = 2, mask: str = "") -> None:
        super().__init__()
        self.heads, self.mask = heads, mask
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (m(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        mask = self.MASKS[self.mask](s) if self.mask else None
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
        _close(planner.plan(module, (x,), backend="reference", cache=False)(x), module(x))


def test_the_causal_flag_and_the_scale_reach_the_ops() -> None:
    graph = import_module(SeparateAttention().eval(), (torch.randn(1, 6, 32),)).graph
    (scores,) = [n for n in graph.ops if n.op == "BatchScores"]
    (scaled,) = [n for n in graph.ops if n.op == "Affine"]
    assert scores.attr_dict["causal"] == 0 and scaled.attr_dict["a"] == pytest.approx(0.3)
    packed = import_module(PackedAttention().eval(), (torch.randn(1, 6, 32),)).graph
    (scores,) = [n for n in packed.ops if n.op == "BatchScores"]
    (scaled,) = [n for n in packed.ops if n.op == "Affine"]
    assert scores.attr_dict["causal"] == 1 and scaled.attr_dict["a"] == pytest.approx(1 / 8 ** 0.5)


def test_a_constant_bool_mask_is_added_as_0_and_minus_inf_and_equals_eager() -> None:
    torch.manual_seed(0)
    module, x = SeparateAttention(mask="window").eval(), torch.randn(2, 8, 32)  # a (s, s) mask, one row per query
    ops = _ops(module, x)
    assert "Opaque" not in ops and {"GroupRepeat", "Add", "BatchScores"} <= set(ops) and "MaskAdd" not in ops
    with torch.no_grad():
        _close(planner.plan(module, (x,), backend="cpu", cache=False)(x), module(x))


def test_a_constant_mask_of_the_causal_triangle_is_causal_attention() -> None:
    """transformers' mask for a batch of several sequences without padding, bool or float (0 and the dtype's
    minimum): the causal kernel, which skips the hidden keys."""
    torch.manual_seed(0)
    module, x = SeparateAttention(mask="causal").eval(), torch.randn(2, 8, 32)
    graph = import_module(module, (x,)).graph
    (scores,) = [n for n in graph.ops if n.op == "BatchScores"]
    assert scores.attr_dict["causal"] == 1 and not {"GroupRepeat", "Add", "Opaque"} & {n.op for n in graph.ops}
    with torch.no_grad():
        _close(planner.plan(module, (x,), backend="cpu", cache=False)(x), module(x))
    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    floats = torch.zeros(2, 1, 8, 8).masked_fill(~keep, torch.finfo(torch.float32).min)
    assert causal_mask(floats, (2, 2, 8, 8)) and causal_mask(keep, (2, 2, 8, 8))
    assert not causal_mask(floats.masked_fill(~keep, -1.0), (2, 2, 8, 8))  # a mask that only lowers the scores
    assert not causal_mask(keep.tril(-1), (2, 2, 8, 8)) and not causal_mask(keep, (2, 2, 8, 9))


def test_a_constant_mask_that_hides_every_key_of_a_query_stays_torchs_sdpa() -> None:
    """torch's attention gives such a query 0, a softmax of its -inf scores NaN: the call stays torch's."""
    torch.manual_seed(0)
    module, x = SeparateAttention(mask="hidden").eval(), torch.randn(2, 8, 32)
    assert "Opaque" in _ops(module, x)
    with torch.no_grad():
        want = module(x)
        assert torch.equal(want[:, 0], torch.zeros_like(want[:, 0]))
        _close(planner.plan(module, (x,), backend="cpu", cache=False)(x), want)


class PaddedAttention(nn.Module):
    """BERT's form with its padding: an additive mask (batch, 1, 1, keys) given with the input."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.inner = SeparateAttention(d, heads)

    def forward(self, x, mask):
        b, s, d = x.shape
        q, k, v = (m(x).view(b, s, self.inner.heads, -1).transpose(1, 2) for m in (self.inner.q, self.inner.k, self.inner.v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)


def test_a_padding_mask_input_fuses_into_masked_attention_and_equals_eager() -> None:
    torch.manual_seed(0)
    module, x = PaddedAttention().eval(), torch.randn(2, 8, 32)
    mask = torch.zeros(2, 1, 1, 8)
    mask[0, ..., 5:] = torch.finfo(torch.float32).min  # batch 0 has 3 padding tokens
    graph = import_module(module, (x, mask)).graph
    ops = [n.op for n in graph.ops]
    assert "Opaque" not in ops and {"GroupRepeat", "MaskAdd"} <= set(ops)
    result = planner.plan(module, (x, mask), backend="cpu", cache=False, max_candidates=6)
    assert any(k.body.op == "MaskedAttention" for p in result.candidates.plans for k in p.kernels)
    with torch.no_grad():
        _close(result(x, mask), module(x, mask))
        other = torch.zeros(2, 1, 1, 8)
        other[1, ..., :2] = -torch.inf  # another call's mask: the plan reads it, it is not a constant
        _close(result(x, other), module(x, other))


class HeadBiasedAttention(PaddedAttention):
    """A bias per head (ALiBi's distances times a slope per head, T5's position bias), a constant, plus the mask
    given with the input."""

    def forward(self, x, mask):
        b, s, d = x.shape
        slopes = torch.tensor([0.5, 0.25]).view(1, 2, 1, 1)
        distance = torch.arange(s).view(1, s) - torch.arange(s).view(s, 1)
        return super().forward(x, mask + slopes * -distance.abs())


@pytest.mark.parametrize(("batch", "mask_batch", "fused"), [(2, 2, True), (1, 1, True), (2, 1, False)],
                         ids=["per-batch", "one-batch", "shared-over-a-batch"])
def test_a_mask_per_head_is_added_to_each_heads_scores_and_equals_eager(batch, mask_batch, fused) -> None:
    """(batch, heads, S, T) masks take the scores' own group order: the attention is op-table ops (the mask,
    computed by torch from the input and the bias, one Opaque node). One shared by every batch of several,
    (1, heads, S, T), would need its groups interleaved: the attention stays torch's call."""
    torch.manual_seed(0)
    module, x = HeadBiasedAttention().eval(), torch.randn(batch, 8, 32)
    mask = torch.zeros(mask_batch, 1, 1, 8)
    mask[0, ..., 6:] = torch.finfo(torch.float32).min
    ops = import_module(module, (x, mask)).graph.ops
    torch_sdpa = [n for n in ops if n.op == "Opaque" and "scaled_dot_product" in n.attr_dict["impl"]]
    assert (not torch_sdpa) == fused and ("BatchScores" in {n.op for n in ops}) == fused
    result = planner.plan(module, (x, mask), backend="cpu", cache=False, max_candidates=4)
    with torch.no_grad():
        _close(result(x, mask), module(x, mask))
        other = torch.zeros_like(mask)
        other[-1, ..., :3] = -1e4
        _close(result(x, other), module(x, other))


def test_a_bool_mask_input_is_a_clear_error_naming_it() -> None:
    from planner.torch.errors import TorchImportError

    module, x = PaddedAttention().eval(), torch.randn(2, 8, 32)
    keep = torch.ones(2, 1, 1, 8, dtype=torch.bool)  # no graph input holds bools: pass the additive float mask
    with pytest.raises(TorchImportError, match="input 1 has dtype bool"):
        planner.plan(module, (x, keep), backend="reference", cache=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_transformer_block_has_no_opaque_node_and_plans_with_fused_attention(dtype: str) -> None:
    module, (x,) = load_factory(str(ROOT / "examples/transformer_block.py:build"),
                                {"d_model": 64, "heads": 4, "seq": 16, "dtype": dtype})
    ops = _ops(module, x)
    if dtype == "fp32":
        assert "Opaque" not in ops and set(ops) >= ATTENTION_OPS
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=12)
    if dtype == "fp32":  # the fused kernel is searched and verified; which one wins is the measurement's call
        fused = [e for e in result.search_result.entries
                 if any(k.describe() == "standalone[Attention]" for k in e.plan.kernels)]
        assert any(e.verified and e.timed for e in fused), [e.verdict for e in fused]
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
    copy = {"impl": "torch.ops.aten.contiguous.default", "args": [{"$step": 2}], "kwargs": {"$dict": {}}, "item": -1,
            "out": [2, 4, 5, 2]}  # Whisper's transpose(1, 2).contiguous()
    assert head_split([split, view, swap, copy], [(2, 5, 24)]) == head_split([split, view, swap], [(2, 5, 24)])
    channels_last = {**copy, "kwargs": {"$dict": {"memory_format": {"$memory_format": "channels_last"}}}}
    assert head_split([split, view, swap, channels_last], [(2, 5, 24)]) is None
    merge = {"impl": "torch.Tensor.transpose", "args": [{"$in": 0}, 1, 2], "kwargs": {"$dict": {}}, "item": -1,
             "out": [2, 5, 4, 2]}
    reshape = {"impl": "torch.Tensor.reshape", "args": [{"$step": 0}, 2, 5, 8], "kwargs": {"$dict": {}}, "item": -1,
               "out": [2, 5, 8]}
    assert head_merge([merge, reshape], [(2, 4, 5, 2)], (2, 5, 8)) == 4
    assert head_merge([merge], [(2, 4, 5, 2)], (2, 5, 4, 2)) is None  # not merged into token rows


def test_a_slice_of_packed_columns_is_a_head_split_and_alone_a_column_take() -> None:
    """Phi-3 slices its packed qkv (``qkv[..., a:b]``, aten.slice of the last dim) where GPT-2 splits it; a
    chunk, split or slice alone (its gate_up_proj's ``chunk(2, -1)``) takes columns."""
    sliced = {"impl": "torch.ops.aten.slice.Tensor", "args": [{"$in": 0}, 2, 8, 16], "kwargs": {"$dict": {}},
              "item": -1, "out": [2, 5, 8]}
    view = {"impl": "torch.ops.aten.view.default", "args": [{"$step": 0}, [2, 5, 4, 2]], "kwargs": {"$dict": {}},
            "item": -1, "out": [2, 5, 4, 2]}
    swap = {"impl": "torch.ops.aten.transpose.int", "args": [{"$step": 1}, 1, 2], "kwargs": {"$dict": {}},
            "item": -1, "out": [2, 4, 5, 2]}
    assert head_split([sliced, view, swap], [(2, 5, 24)]) == (0, HeadSplit(heads=4, seq=5, offset=8, width=8))
    assert column_take([sliced], [(2, 5, 24)], (2, 5, 8)) == (8, 8)
    chunk = {"impl": "torch.ops.aten.chunk.default", "args": [{"$in": 0}, 2, -1], "kwargs": {"$dict": {}},
             "item": 1, "out": [2, 5, 12]}
    assert column_take([chunk], [(2, 5, 24)], (2, 5, 12)) == (12, 12)
    assert column_take([{**sliced, "args": [{"$in": 0}, 1, 0, 2]}], [(2, 5, 24)], (2, 2, 24)) is None  # rows
    assert column_take([sliced, view], [(2, 5, 24)], (2, 5, 4, 2)) is None


# ---------------------------------------------------------------- RoPE


class RopeAttention(nn.Module):
    """LLaMA's attention written by hand: q and k rotated by x*cos + rotate_half(x)*sin before causal SDPA;
    ``rotate`` is how rotate_half is spelt (slices, chunk, or a wrong one that must stay torch's)."""

    def __init__(self, d: int = 32, heads: int = 2, seq: int = 8, rotate: str = "slices") -> None:
        super().__init__()
        self.heads, self.rotate = heads, rotate
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(seq).float(), inv)
        emb = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", emb.cos()[None, None])
        self.register_buffer("sin", emb.sin()[None, None])

    def rotate_half(self, x):
        if self.rotate == "chunk":
            x1, x2 = x.chunk(2, dim=-1)
        else:
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((x2, -x1) if self.rotate == "wrong" else (-x2, x1), dim=-1)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (m(x).view(b, s, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        q = q * self.cos + self.rotate_half(q) * self.sin
        k = k * self.cos + self.rotate_half(k) * self.sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("rotate", ["slices", "chunk"])
def test_rope_imports_as_rotate_half_and_tile_products_and_equals_eager(rotate: str) -> None:
    torch.manual_seed(0)
    module, x = RopeAttention(rotate=rotate).eval(), torch.randn(2, 8, 32)
    ops = _ops(module, x)
    assert "Opaque" not in ops and ops.count("RotateHalf") == 2 and ops.count("TileMul") == 4
    assert set(ops) >= ATTENTION_OPS
    with torch.no_grad():
        _close(planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=6)(x), module(x))


def test_a_rotation_that_is_not_rotate_half_stays_torch_and_equals_eager() -> None:
    torch.manual_seed(0)
    module, x = RopeAttention(rotate="wrong").eval(), torch.randn(2, 8, 32)  # cat(x2, -x1): the other sign
    ops = _ops(module, x)
    assert "RotateHalf" not in ops and "Opaque" in ops
    with torch.no_grad():
        _close(planner.plan(module, (x,), backend="reference", cache=False)(x), module(x))


def test_rotate_half_reads_the_recorded_steps() -> None:
    def step(impl, *args, **kw):
        return {"impl": impl, "args": list(args), "kwargs": {"$dict": kw}, "item": -1}

    hi = step("torch.ops.aten.slice.Tensor", {"$in": 0}, 3, 4, 2**63 - 1)
    neg = step("torch.ops.aten.neg.default", {"$step": 0})
    lo = step("torch.ops.aten.slice.Tensor", {"$in": 0}, 3, 0, 4)
    cat = step("torch.ops.aten.cat.default", [{"$step": 1}, {"$step": 2}], -1)
    shape = [(2, 2, 5, 8)]
    assert rotate_half([hi, neg, lo, cat], shape, shape[0])
    assert not rotate_half([hi, neg, lo, step("torch.ops.aten.cat.default", [{"$step": 2}, {"$step": 1}], -1)],
                           shape, shape[0])  # cat(x1, -x2)
    assert not rotate_half([hi, neg, lo, step("torch.ops.aten.cat.default", [{"$step": 1}, {"$step": 2}], 2)],
                           shape, shape[0])  # concatenated along another dim
    assert not rotate_half([{**hi, "args": [{"$in": 0}, 3, 3, 8]}, neg, lo, cat], shape, shape[0])  # not halves
    ellipsis = step("torch.operator.getitem", {"$in": 0}, {"$tuple": [{"$ellipsis": 0}, {"$slice": [4, None, None]}]})
    first = step("torch.operator.getitem", {"$in": 0}, {"$tuple": [{"$ellipsis": 0}, {"$slice": [None, 4, None]}]})
    torch_form = [ellipsis, step("torch.operator.neg", {"$step": 0}), first,
                  step("torch.cat", {"$tuple": [{"$step": 1}, {"$step": 2}]}, dim=-1)]
    assert rotate_half(torch_form, shape, shape[0])


def test_rope_under_torch_compile_has_no_opaque_node_and_equals_eager() -> None:
    """Dynamo hands cos and sin over as graph inputs (module buffers lifted): tiles all the same."""
    from planner.torch.importer import import_fx_graph

    torch.manual_seed(0)
    module, x = RopeAttention().eval(), torch.randn(2, 8, 32)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append([n.op for n in import_fx_graph(gm, example_inputs).graph.ops])
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(module, backend=capture)(x)
        torch._dynamo.reset()
        got = torch.compile(module, backend="fusion_planner", options={"backend": "reference"})(x)
        _close(got, module(x))
    torch._dynamo.reset()
    (ops,) = graphs
    assert "Opaque" not in ops and ops.count("RotateHalf") == 2 and ops.count("TileMul") == 4

"""Layers taken from the ``transformers`` package itself (small configs, random weights, nothing downloaded) plan
from Python and equal eager torch: GPT-2's block (Conv1D, the written-out GELU, causal SDPA), BERT's and ViT's
layers (LayerNorm, SDPA) and LLaMA's decoder layer (hand-written RMSNorm, RoPE, SwiGLU, causal SDPA) with no
Opaque node and the fused Attention kernel; BERT with its padding mask too (MaskedAttention)."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _layers import FirstOutput  # noqa: E402
from torch import nn  # noqa: E402

import planner  # noqa: E402
from planner.api import allclose_report  # noqa: E402
from planner.torch.importer import TORCH_DTYPES, import_module  # noqa: E402

D, HEADS, SEQ = 64, 4, 16


def _gpt2() -> nn.Module:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return FirstOutput(GPT2Block(GPT2Config(n_embd=D, n_head=HEADS, attn_implementation="sdpa")))


def _bert() -> nn.Module:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    return FirstOutput(BertLayer(BertConfig(hidden_size=D, num_attention_heads=HEADS, intermediate_size=4 * D,
                                            attn_implementation="sdpa")))


def _vit() -> nn.Module:
    from transformers import ViTConfig
    from transformers.models.vit.modeling_vit import ViTLayer

    return FirstOutput(ViTLayer(ViTConfig(hidden_size=D, num_attention_heads=HEADS, intermediate_size=4 * D,
                                          attn_implementation="sdpa")))


def _llama() -> nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=2 * D,
                      attn_implementation="sdpa")
    return FirstOutput(LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg))


def _close(got, want) -> None:
    ok, max_abs, max_rel = allclose_report(got.float().numpy(), want.float().numpy(), TORCH_DTYPES[want.dtype])
    assert ok, (max_abs, max_rel)


@pytest.mark.parametrize("factory", [_gpt2, _bert, _vit, _llama], ids=["gpt2-block", "bert-layer", "vit-layer", "llama-layer"])
def test_transformers_layers_plan_with_no_opaque_node_and_fused_attention(factory) -> None:
    torch.manual_seed(0)
    module, x = factory().eval(), torch.randn(2, SEQ, D)
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert "Opaque" not in ops and ops["Heads"] == 3 and ops["BatchScores"] == 1 and ops["Merge"] == 1
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=6)
    assert any(k.body.op == "Attention" for p in result.candidates.plans for k in p.kernels)
    with torch.no_grad():
        _close(result(x), module(x))


def test_gpt2_written_out_gelu_becomes_the_op_the_epilogues_know() -> None:
    torch.manual_seed(0)
    module, x = _gpt2().eval(), torch.randn(2, SEQ, D)
    result = planner.plan(module, (x,), backend="reference", cache=False)
    bodies = {e.op for p in result.candidates.plans for k in p.kernels for e in k.body.walk()}
    assert "GeluTanh" in bodies  # algebra.egg: 0.5*x*(1 + tanh(...)) is GeluTanh, so cuBLASLt's GELU_BIAS applies


def test_llama_rope_is_one_elementwise_kernel_over_the_heads() -> None:
    torch.manual_seed(0)
    module, x = _llama().eval(), torch.randn(2, SEQ, D)
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert ops["RowMean"] == 2 and ops["Rsqrt"] == 2 and ops["Silu"] == 1  # RMSNorm x2 and SwiGLU, native
    assert ops["RotateHalf"] == 2 and ops["TileMul"] == 4  # q and k: x*cos + rotate_half(x)*sin
    result = planner.plan(module, (x,), backend="reference", cache=False, max_candidates=4)
    rope = [sorted(e.op for e in k.body.walk()) for p in result.candidates.plans for k in p.kernels
            if any(e.op == "RotateHalf" for e in k.body.walk())]
    assert ["Add", "RotateHalf", "TileMul", "TileMul"] in rope
    with torch.no_grad():
        _close(result(x), module(x))


def test_llama_bf16_rmsnorm_computes_in_fp32_through_casts_in_one_row_kernel() -> None:
    # LLaMA's RMSNorm: x.to(float32), pow/mean/rsqrt in fp32, .to(bfloat16), then the bf16 weight
    torch.manual_seed(0)
    module, x = _llama().eval().to(torch.bfloat16), torch.randn(2, SEQ, D, dtype=torch.bfloat16)
    graph = import_module(module, (x,)).graph
    ops = Counter(n.op for n in graph.ops)
    assert "Opaque" not in ops and ops["Cast"] == 4
    assert {n.type.dtype for n in graph.ops if n.op in ("RowMean", "Rsqrt", "MulRow")} == {"fp32"}
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=6)
    norms = [sorted(e.op for e in k.body.walk()) for k in result.candidates.best.kernels
             if any(e.op == "RowMean" for e in k.body.walk())]
    assert sorted(["BiasMul", "Cast", "Cast", "MulRow", "Rsqrt", "RowMean", "Square", "Affine"]) in norms
    with torch.no_grad():
        _close(result(x), module(x))


class WithMask(nn.Module):
    """A layer called with its additive attention mask (batch, 1, 1, keys), as the model hands it down."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x, mask):
        out = self.layer(x, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


def test_bert_layer_with_a_padding_mask_has_no_opaque_node_and_equals_eager() -> None:
    torch.manual_seed(0)
    module, x = WithMask(_bert().layer).eval(), torch.randn(2, SEQ, D)
    mask = torch.zeros(2, 1, 1, SEQ)
    mask[1, ..., SEQ - 5:] = torch.finfo(torch.float32).min  # the second sequence is 5 tokens shorter
    ops = Counter(n.op for n in import_module(module, (x, mask)).graph.ops)
    assert "Opaque" not in ops and ops["MaskAdd"] == 1 and ops["GroupRepeat"] == 1
    result = planner.plan(module, (x, mask), backend="cpu", cache=False, max_candidates=6)
    assert any(k.body.op == "MaskedAttention" for p in result.candidates.plans for k in p.kernels)
    with torch.no_grad():
        _close(result(x, mask), module(x, mask))


def _eager(name: str) -> tuple[nn.Module, tuple]:
    """The same layers with ``attn_implementation="eager"``: 4-D ``matmul``, ``softmax`` (LLaMA's with
    ``dtype=torch.float32``), the mask added to the scores."""
    from transformers import BertConfig, GPT2Config, LlamaConfig
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    x = torch.randn(2, SEQ, D)
    if name == "gpt2":
        return FirstOutput(GPT2Block(GPT2Config(n_embd=D, n_head=HEADS, attn_implementation="eager"))), (x,)
    if name == "llama":
        cfg = LlamaConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=2 * D,
                          attn_implementation="eager")
        return FirstOutput(LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)), (x,)
    mask = torch.zeros(2, 1, 1, SEQ)
    mask[0, ..., SEQ - 3:] = torch.finfo(torch.float32).min
    layer = BertLayer(BertConfig(hidden_size=D, num_attention_heads=HEADS, intermediate_size=4 * D,
                                 attn_implementation="eager"))
    return WithMask(layer), (x, mask)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert-masked"])
def test_eager_attention_layers_have_no_opaque_node_and_equal_eager(name: str) -> None:
    torch.manual_seed(0)
    module, args = _eager(name)
    module.eval()
    ops = Counter(n.op for n in import_module(module, args).graph.ops)
    assert "Opaque" not in ops and ops["BatchScores"] == 1 and ops["BatchApply"] == 1 and ops["Merge"] == 1
    result = planner.plan(module, args, backend="cpu", cache=False, max_candidates=4)
    fused = {"gpt2": "Attention", "llama": "Attention", "bert-masked": "MaskedAttention"}[name]
    assert any(k.body.op == fused for p in result.candidates.plans for k in p.kernels)
    with torch.no_grad():
        _close(result(*args), module(*args))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_grouped_query_attention_repeats_its_key_and_value_heads_with_no_opaque_node(impl: str) -> None:
    """LLaMA with half as many key/value heads: SDPA's enable_gqa, or eager's repeat_kv (expand, reshape)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                      intermediate_size=2 * D, attn_implementation=impl)
    module, x = FirstOutput(LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)).eval(), torch.randn(2, SEQ, D)
    ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
    assert "Opaque" not in ops and ops["GroupRepeat"] == 2 and ops["BatchScores"] == 1
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=4)
    with torch.no_grad():
        _close(result(x), module(x))

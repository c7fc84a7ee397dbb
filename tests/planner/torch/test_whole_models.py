"""Whole language models from token ids and the layers whose packing, casts and position biases used to stay
torch's: GPT-2, LLaMA, Qwen3 and Gemma3 (q and k normalised per head) and T5's encoder (2 layers) from ``input_ids``, Whisper's encoder from mel frames, Phi-3's decoder layer (packed ``qkv_proj`` sliced,
``gate_up_proj`` chunked), Gemma's (``type_as`` in its RMSNorm) and T5's self-attention with its relative
position bias, each with no Opaque node and equal to eager torch in fp32 and bf16 (transformers' own classes,
small configs, random weights, nothing downloaded)."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import numpy as np  # noqa: E402
from _layers import FirstOutput  # noqa: E402
from torch import nn  # noqa: E402

import planner  # noqa: E402
from backends.cpu.backend import CpuBackend  # noqa: E402
from planner.api import allclose_report  # noqa: E402
from planner.core.cost import load_device  # noqa: E402
from planner.core.inputs import index_rows  # noqa: E402
from planner.core.reference import execute_plan, random_inputs  # noqa: E402
from planner.torch.importer import TORCH_DTYPES, import_module  # noqa: E402

D, HEADS, SEQ, VOCAB = 64, 4, 16, 100
DTYPES = [torch.float32, torch.bfloat16]


class LastHidden(nn.Module):
    """A whole model called with token ids (or another input): its last hidden states."""

    def __init__(self, model: nn.Module, argument: str = "input_ids") -> None:
        super().__init__()
        self.model, self.argument = model, argument

    def forward(self, ids):
        return self.model(**{self.argument: ids}).last_hidden_state


def gpt2_model() -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    return LastHidden(GPT2Model(GPT2Config(n_embd=D, n_head=HEADS, n_layer=2, vocab_size=VOCAB, n_positions=32,
                                           bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")))


def llama_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaModel

    return LastHidden(LlamaModel(LlamaConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                             intermediate_size=2 * D, num_hidden_layers=2, vocab_size=VOCAB,
                                             attn_implementation="sdpa")))


def qwen3_model() -> nn.Module:
    """Qwen3 normalises q and k per head: on ``view(b, s, heads, d)`` of the projection, before the transpose."""
    from transformers import Qwen3Config, Qwen3Model

    return LastHidden(Qwen3Model(Qwen3Config(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                             head_dim=D // HEADS, intermediate_size=2 * D, num_hidden_layers=2,
                                             vocab_size=VOCAB, attn_implementation="sdpa")))


def gemma3_model() -> nn.Module:
    """Gemma3's text model: q and k normalised per head after the transpose (head-major rows), its layers'
    attention local (a sliding window) or global."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    return LastHidden(Gemma3TextModel(Gemma3TextConfig(
        hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, head_dim=D // HEADS,
        intermediate_size=2 * D, num_hidden_layers=2, vocab_size=VOCAB, attn_implementation="sdpa")))


def t5_encoder() -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    return LastHidden(T5EncoderModel(T5Config(d_model=D, d_kv=D // HEADS, num_heads=HEADS, d_ff=2 * D, num_layers=2,
                                              vocab_size=VOCAB)))


def whisper_encoder() -> nn.Module:
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(d_model=D, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_layers=2,
                        encoder_ffn_dim=2 * D, num_mel_bins=8, max_source_positions=SEQ, attn_implementation="sdpa")
    return LastHidden(WhisperModel(cfg).encoder, "input_features")


def phi3_layer() -> nn.Module:
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RotaryEmbedding

    cfg = Phi3Config(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=2 * D,
                     attn_implementation="sdpa")
    return FirstOutput(Phi3DecoderLayer(cfg, 0), Phi3RotaryEmbedding(cfg))


def gemma_layer() -> nn.Module:
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRotaryEmbedding

    cfg = GemmaConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=2 * D,
                      head_dim=D // HEADS, attn_implementation="sdpa")
    return FirstOutput(GemmaDecoderLayer(cfg, 0), GemmaRotaryEmbedding(cfg))


def t5_attention() -> nn.Module:
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    return FirstOutput(T5Attention(T5Config(d_model=D, d_kv=D // HEADS, num_heads=HEADS),
                                   has_relative_attention_bias=True))


#: each model, its example input, and ops its graph must hold
MODELS = {
    "gpt2-model": (gpt2_model, "ids", {"Embedding": 1, "Heads": 6}),
    "llama-model": (llama_model, "ids", {"Embedding": 1, "RotateHalf": 4}),
    # per layer: q and k viewed as heads (Regroup), normalised, back to token rows (Regroup) and Heads
    "qwen3-model": (qwen3_model, "ids", {"Embedding": 1, "Regroup": 8, "Heads": 6, "GroupRepeat": 4}),
    "gemma3-model": (gemma3_model, "ids", {"Embedding": 1, "Heads": 6, "GroupRepeat": 4}),
    # its position bias, one per head, added in the attention (SDPA's attn_mask of (1, heads, S, S))
    "t5-encoder": (t5_encoder, "ids", {"Embedding": 1, "BatchScores": 2, "Add": 2}),
    # 1-D convolutions over mel frames, heads taken out with transpose(1, 2).contiguous()
    "whisper-encoder": (whisper_encoder, "mel", {"Heads": 6, "BatchScores": 2}),
    "phi3-layer": (phi3_layer, "x", {"Heads": 3, "Columns": 2, "RotateHalf": 2}),
    "gemma-layer": (gemma_layer, "x", {"Heads": 3, "GeluTanh": 1}),
    "t5-attention": (t5_attention, "x", {"Heads": 3, "BatchScores": 1, "Add": 1}),
}


def _example(name: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    factory, kind, _ = MODELS[name]
    torch.manual_seed(0)
    module = factory().eval().to(dtype)
    x = (torch.randint(0, VOCAB, (2, SEQ)) if kind == "ids" else torch.randn(2, 8, 2 * SEQ, dtype=dtype) if kind == "mel"
         else torch.randn(2, SEQ, D, dtype=dtype))
    return module, (x,)


def _close(got, want) -> None:
    ok, max_abs, max_rel = allclose_report(got.float().numpy(), want.float().numpy(), TORCH_DTYPES[want.dtype])
    assert ok, (max_abs, max_rel)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_model_plans_with_no_opaque_node_and_equals_eager(name: str, dtype: torch.dtype) -> None:
    module, args = _example(name, dtype)
    ops = Counter(n.op for n in import_module(module, args).graph.ops)
    assert "Opaque" not in ops
    assert all(ops[op] >= count for op, count in MODELS[name][2].items()), ops
    result = planner.plan(module, args, backend="cpu", cache=False, max_candidates=3)
    with torch.no_grad():
        _close(result(*args), module(*args))


@pytest.mark.parametrize("name", ["gpt2-model", "llama-model"])
def test_the_last_layer_repeats_the_others_and_the_final_norm_is_planned_on_its_own(name: str) -> None:
    """The last layer also holds the model's final norm (no forced store ends it): cut where it repeats the
    layers before it, its attention and MLP are searched once for both layers."""
    module, args = _example(name, torch.float32)
    result = planner.plan(module, args, backend="cpu", cache=False, max_candidates=3)
    mp = result.model_plan
    assert mp is not None and [u.instances for u in mp.unique.values()] == [1, 2, 2, 1]  # embedding ... final norm
    assert len(result.planned.region_searches) == 4
    with torch.no_grad():
        _close(result(*args), module(*args))


def test_t5s_position_bias_fuses_into_one_biased_attention_kernel() -> None:
    """T5 adds its relative position bias (a row of keys per query) to the scores: attention.egg's biased rule
    makes the softmax and both products one BiasedAttention kernel, a candidate that equals eager torch."""
    module, args = _example("t5-attention", torch.bfloat16)
    result = planner.plan(module, args, backend="cpu", cache=False, max_candidates=8)
    fused = [p for p in result.candidates.plans if any(k.body.op == "BiasedAttention" for k in p.kernels)]
    assert fused
    compiled = CpuBackend(load_device("h200"), threads=2).compile(fused[0])
    inputs = random_inputs(result.graph, seed=1)
    got, want = compiled.run(inputs)[0].astype(np.float32), execute_plan(fused[0], inputs)[0].astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["gpt2-model", "llama-model"])
def test_a_model_called_as_users_call_it_returns_its_output_and_cache_equal_to_eager(name: str) -> None:
    """``GPT2Model(ids)`` itself, ``use_cache`` on as by default: its ``ModelOutput`` with the ``DynamicCache``
    (torch.export takes it through transformers' own registration), every tensor equal to eager torch's."""
    model = MODELS[name][0]().model.eval()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    result = planner.plan(model, (ids,), backend="cpu", max_candidates=3)
    got = result(ids)
    with torch.no_grad():
        want = model(ids)
    assert type(got) is type(want) and type(got.past_key_values) is type(want.past_key_values)
    got_leaves, want_leaves = (torch.utils._pytree.tree_leaves(o) for o in (got, want))
    assert len(got_leaves) == len(want_leaves) == 1 + 2 * 2  # the hidden states, then each layer's keys and values
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert torch.allclose(g, w, atol=1e-5), float((g - w).abs().max())
    assert not [k for k in result.plan.kernels if k.kind == "opaque"]


def test_a_model_from_token_ids_takes_other_ids_and_refuses_ids_outside_its_table() -> None:
    module, (ids,) = _example("gpt2-model", torch.float32)
    result = planner.plan(module, (ids,), backend="cpu", cache=False, max_candidates=2)
    other = torch.randint(0, VOCAB, ids.shape)
    with torch.no_grad():
        _close(result(other), module(other))
    with pytest.raises(IndexError, match=f"id {VOCAB} is not a row of a table of {VOCAB} rows"):
        result(torch.full_like(ids, VOCAB))


@pytest.mark.parametrize("name", ["t5-attention", "gemma-layer"])
def test_a_write_to_a_parameter_a_value_was_computed_from_at_import_plans_again(name: str) -> None:
    """T5's position bias (from its bias table) and Gemma's norm scale (1 + weight) are computed once at import;
    a write to the parameter behind them, even through ``.data``, is a change of the module: planned again."""
    module, args = _example(name, torch.float32)
    result = planner.plan(module, args, backend="cpu", cache=False, max_candidates=2)
    attention = module.layer if name == "t5-attention" else module.layer.input_layernorm
    table = attention.relative_attention_bias.weight if name == "t5-attention" else attention.weight
    assert any(table is p for p in module.parameters())
    with torch.no_grad():
        table.data.copy_(torch.randn_like(table))
        _close(result(*args), module(*args))
    assert any("computed a value at import" in reason and action == "plans again"
               for reason, action in result.guard.events)


class Masked(nn.Module):
    """A whole model called with token ids and an ``attention_mask`` of 1s and 0s (padding)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def bert_model() -> nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(hidden_size=D, num_attention_heads=HEADS, intermediate_size=2 * D, num_hidden_layers=2,
                                vocab_size=VOCAB, attn_implementation="sdpa"), add_pooling_layer=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_a_padding_mask_computed_from_the_call_inputs_fuses_into_attention_and_equals_eager(name, dtype) -> None:
    """transformers builds a bool mask from ``attention_mask`` (BERT: the padded keys; LLaMA: those and the causal
    triangle, so a left-padded row's first queries see no key, where torch's attention gives 0): one Opaque node
    computes it as an additive mask for every layer, the attention is op-table ops, and the plan equals eager for
    other masks at call time."""
    torch.manual_seed(0)
    model = (bert_model() if name == "bert" else llama_model().model).eval().to(dtype)
    module = Masked(model)
    ids, mask = torch.randint(0, VOCAB, (2, SEQ)), torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :5] = 0  # the second row left padded
    graph = import_module(module, (ids, mask)).graph
    opaque = [n for n in graph.ops if n.op == "Opaque"]
    assert len(opaque) == 1 and opaque[0].attr_dict["impl"] == "torch.where"
    assert Counter(n.op for n in graph.ops)["BatchScores"] == 2
    assert index_rows(graph)["mask"] == 2  # the recipe's masks are 0s and 1s: index 0 alone would hide every key
    result = planner.plan(module, (ids, mask), backend="cpu", cache=False, max_candidates=3)
    mp = result.model_plan  # the two layers repeat: the mask they share is prepared once, a region of its own
    assert mp is not None and sum(u.instances > 1 for u in mp.unique.values()) >= 1
    entries = [e for search in result.planned.region_searches.values() for e in search.entries]
    # the fused form is verified (whether it is chosen is measured: on a busy machine a tie may keep another)
    assert any(e.verified and any(k.body.op == "BiasedAttention" for k in e.plan.kernels) for e in entries)
    with torch.no_grad():
        for m in (mask, torch.ones_like(mask), torch.tensor([[1] * (SEQ - 3) + [0] * 3, [0] * 9 + [1] * (SEQ - 9)])):
            want = module(ids, m)
            assert torch.isfinite(want).all()
            _close(result(ids, m), want)


def test_a_model_whose_caller_leaves_part_of_its_result_unused_plans_and_equals_eager() -> None:
    """CLIP's vision model computes a pooled output beside its hidden states; returning the hidden states only
    leaves the pooling's ops unused: they are not planned (they made a region with no outputs, which failed)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    model = CLIPVisionModel(CLIPVisionConfig(hidden_size=D, num_attention_heads=HEADS, intermediate_size=2 * D,
                                             num_hidden_layers=1, image_size=32, patch_size=8,
                                             attn_implementation="sdpa")).eval()

    class Hidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixels):
            return self.model(pixel_values=pixels).last_hidden_state

    module, x = Hidden(), torch.randn(1, 3, 32, 32)
    graph = import_module(module, (x,)).graph
    assert len(graph.live().nodes) < len(graph.nodes)
    result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=2)
    with torch.no_grad():
        _close(result(x), module(x))


def test_a_view_of_a_computed_value_as_rows_of_another_length_is_a_regroup_and_a_flat_one_stays_torchs() -> None:
    """Heads normalised on ``view(b, s, h, d)`` and viewed back: Regroup both ways, equal to eager; a view to
    1-D (no rows) is left to torch."""

    class PerHead(nn.Module):
        def __init__(self, flat: bool) -> None:
            super().__init__()
            self.proj, self.norm, self.flat = nn.Linear(D, D), nn.RMSNorm(D // HEADS), flat

        def forward(self, x):
            y = self.norm(self.proj(x).view(2, SEQ, HEADS, D // HEADS)).view(2, SEQ, D)
            return y.view(-1).tanh() if self.flat else y.tanh()

    x = torch.randn(2, SEQ, D)
    for flat, regroups in ((False, 2), (True, 1)):
        module = PerHead(flat).eval()
        ops = Counter(n.op for n in import_module(module, (x,)).graph.ops)
        assert ops["Regroup"] == regroups and ("Opaque" in ops) == flat, ops
        result = planner.plan(module, (x,), backend="cpu", cache=False, max_candidates=3)
        with torch.no_grad():
            _close(result(x), module(x))


def test_a_sliding_window_model_plans_and_only_opaque_nodes_it_runs_warn(caplog) -> None:
    """Gemma3 with a window shorter than the sequence: the sliding layers' cache slices (Opaque, read by no output)
    are left out of the plan, so no warning about torch's threads; the result equals eager."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                           head_dim=D // HEADS, intermediate_size=2 * D, num_hidden_layers=2, vocab_size=VOCAB,
                           sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                           attn_implementation="sdpa")
    module = LastHidden(Gemma3TextModel(cfg)).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    assert "Opaque" in {n.op for n in import_module(module, (ids,)).graph.ops}
    result = planner.plan(module, (ids,), backend="cpu", cache=False, max_candidates=3)
    assert "Opaque" not in {k.body.op for k in result.plan.kernels}
    assert "spinning OpenMP" not in caplog.text
    with torch.no_grad():
        _close(result(ids), module(ids))

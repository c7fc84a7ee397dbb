"""Layers of the ``transformers`` package, planned by fusion-planner, against eager torch and torch.compile.

Usage: python benchmarks/transformers_layers.py [--out docs/results/transformers_layers.md] [--rounds 11]
                                               [--layers gpt2,bert,vit,llama,bert-masked,llama-gqa,phi3,gemma,
                                                t5-attention,gpt2-model,llama-model,qwen3-model,
                                                bert-model-padded,llama-model-padded] [--dtypes fp32,bf16] [--modes 1,all]

Needs the ``models`` extra (``transformers``).  Each layer is built from its own config at GPT-2 small's width
(768 wide, 12 heads, 128 tokens, batch 1; LLaMA with a SwiGLU of 2,048), random weights, ``attn_implementation=
"sdpa"``, nothing downloaded; ``bert-masked`` is BERT's layer with a padding mask (the last 16 tokens hidden,
BERT's additive ``finfo.min`` mask of shape (1, 1, 1, 128), a buffer of the wrapper), ``llama-gqa`` LLaMA's with
4 key/value heads for its 12 query heads (grouped-query attention); ``phi3`` and ``gemma`` their decoder layers
(Phi-3's packed qkv and gate/up projections, a SwiGLU of 2,048; Gemma's GeGLU), ``t5-attention`` T5's
self-attention with its relative position bias, ``gpt2-model``, ``llama-model`` and ``qwen3-model`` whole 2-layer models (a
vocabulary of 32,000; Qwen3 with 4 key/value heads, q and k normalised per head) called with 128 token ids; ``bert-model-padded`` and ``llama-model-padded`` whole 2-layer
models called with a batch of 2 x 128 token ids and an ``attention_mask`` padding the second sequence by 32 (BERT
at its end, LLaMA at its start: its first queries see no key).  Per thread mode and dtype a child process (``1``: one thread pinned to one core;
``all``: every core; the same environment as ``cpu_peers.py``) plans the layer with ``planner.plan(...,
backend="cpu")``, checks the planned call against eager torch within the dtype's tolerance, then times eager,
torch.compile (inductor) and the planned call in interleaved rounds (three calls each, the order rotating); a
figure is the median in µs.  On every core each turn first runs its contender untimed for ``cpu_peers.SETTLE_S``
(another library's spinning workers, or this one's sleeping ones, would slow its first calls).  The report lists how many kernels of the plan are Opaque torch calls.
"""

from __future__ import annotations

from typing import Any

from against_torch import main

LAYERS = ("gpt2", "bert", "vit", "llama", "bert-masked", "llama-gqa", "phi3", "gemma", "t5-attention", "gpt2-model",
          "llama-model", "qwen3-model", "bert-model-padded", "llama-model-padded")
#: whole models called with token ids (2 layers, a vocabulary of 32,000): their last hidden states; ``-padded``: a
#: batch of 2 with an ``attention_mask`` that pads one sequence
MODELS = ("gpt2-model", "llama-model", "qwen3-model", "bert-model-padded", "llama-model-padded")
#: padding tokens of the padded models' second sequence (BERT's at its end, LLaMA's at its start)
PADDING = 32
CONTENDERS = ("torch", "torch.compile", "fp.call")
D, HEADS, SEQ = 768, 12, 128


def build_model(name: str, dtype: str) -> tuple[Any, Any]:
    """(module returning the last hidden states, token ids) for a whole model of 2 layers."""
    import torch
    import transformers
    from torch import nn

    torch.manual_seed(0)
    if name == "gpt2-model":
        model = transformers.GPT2Model(transformers.GPT2Config(n_embd=D, n_head=HEADS, n_layer=2, vocab_size=32000,
                                                               attn_implementation="sdpa"))
    elif name == "qwen3-model":
        model = transformers.Qwen3Model(transformers.Qwen3Config(
            hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=4, head_dim=D // HEADS, intermediate_size=2048,
            num_hidden_layers=2, vocab_size=32000, attn_implementation="sdpa"))
    elif name == "bert-model-padded":
        model = transformers.BertModel(transformers.BertConfig(
            hidden_size=D, num_attention_heads=HEADS, intermediate_size=4 * D, num_hidden_layers=2, vocab_size=32000,
            attn_implementation="sdpa"), add_pooling_layer=False)
    else:
        model = transformers.LlamaModel(transformers.LlamaConfig(
            hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=2048,
            num_hidden_layers=2, vocab_size=32000, attn_implementation="sdpa"))

    class LastHidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    module = LastHidden().eval().to(kind)
    if not name.endswith("-padded"):
        return module, torch.randint(0, 32000, (1, SEQ))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if name.startswith("bert"):
        mask[1, SEQ - PADDING:] = 0
    else:
        mask[1, :PADDING] = 0
    return module, (torch.randint(0, 32000, (2, SEQ)), mask)


def build_layer(name: str, dtype: str) -> tuple[Any, Any]:
    """(module returning the hidden states, its input) for one layer of the transformers package."""
    import torch
    import transformers
    from torch import nn

    if name in MODELS:
        return build_model(name, dtype)
    torch.manual_seed(0)
    rope, mask = None, None
    if name == "bert-masked":
        mask = torch.zeros(1, 1, 1, SEQ)
        mask[..., SEQ - 16:] = torch.finfo(torch.float32).min
        name = "bert"
    kv_heads = 4 if name == "llama-gqa" else HEADS
    name = "llama" if name == "llama-gqa" else name
    if name == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        layer = GPT2Block(transformers.GPT2Config(n_embd=D, n_head=HEADS, attn_implementation="sdpa"))
    elif name == "bert":
        from transformers.models.bert.modeling_bert import BertLayer

        layer = BertLayer(transformers.BertConfig(hidden_size=D, num_attention_heads=HEADS, intermediate_size=4 * D,
                                                  attn_implementation="sdpa"))
    elif name == "vit":
        from transformers.models.vit.modeling_vit import ViTLayer

        layer = ViTLayer(transformers.ViTConfig(hidden_size=D, num_attention_heads=HEADS, intermediate_size=4 * D,
                                                attn_implementation="sdpa"))
    elif name == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        cfg = transformers.LlamaConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                                       intermediate_size=2048, attn_implementation="sdpa")
        layer, rope = LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)
    elif name == "phi3":
        from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RotaryEmbedding

        cfg = transformers.Phi3Config(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                      intermediate_size=2048, attn_implementation="sdpa")
        layer, rope = Phi3DecoderLayer(cfg, 0), Phi3RotaryEmbedding(cfg)
    elif name == "gemma":
        from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, GemmaRotaryEmbedding

        cfg = transformers.GemmaConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                       head_dim=D // HEADS, intermediate_size=2048, attn_implementation="sdpa")
        layer, rope = GemmaDecoderLayer(cfg, 0), GemmaRotaryEmbedding(cfg)
    elif name == "t5-attention":
        from transformers.models.t5.modeling_t5 import T5Attention

        layer = T5Attention(transformers.T5Config(d_model=D, d_kv=D // HEADS, num_heads=HEADS),
                            has_relative_attention_bias=True)
    else:
        raise SystemExit(f"unknown layer {name!r}; choose from {', '.join(LAYERS)}")

    class Hidden(nn.Module):
        """The layer's hidden states (a transformers layer returns a tuple or a tensor, by version)."""

        def __init__(self) -> None:
            super().__init__()
            self.layer, self.rope = layer, rope
            self.register_buffer("mask", mask)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.mask is not None:
                out = self.layer(x, attention_mask=self.mask.to(x.dtype))
            elif self.rope is None:
                out = self.layer(x)
            else:
                pos = torch.arange(x.shape[1]).unsqueeze(0)
                out = self.layer(x, position_embeddings=self.rope(x, pos), position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

    kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    return Hidden().eval().to(kind), torch.randn(1, SEQ, D, dtype=kind)


if __name__ == "__main__":
    main(__doc__, build_layer, LAYERS, "Layers of the transformers package", "layer", __file__)

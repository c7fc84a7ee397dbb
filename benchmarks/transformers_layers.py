"""Layers of the ``transformers`` package, planned by fusion-planner, against eager torch and torch.compile.

Usage: python benchmarks/transformers_layers.py [--out docs/results/transformers_layers.md] [--rounds 11]
                                               [--layers gpt2,bert,vit,llama,bert-masked,llama-gqa,phi3,gemma,
                                                t5-attention,gpt2-model,llama-model] [--dtypes fp32,bf16] [--modes 1,all]

Needs the ``models`` extra (``transformers``).  Each layer is built from its own config at GPT-2 small's width
(768 wide, 12 heads, 128 tokens, batch 1; LLaMA with a SwiGLU of 2,048), random weights, ``attn_implementation=
"sdpa"``, nothing downloaded; ``bert-masked`` is BERT's layer with a padding mask (the last 16 tokens hidden,
BERT's additive ``finfo.min`` mask of shape (1, 1, 1, 128), a buffer of the wrapper), ``llama-gqa`` LLaMA's with
4 key/value heads for its 12 query heads (grouped-query attention); ``phi3`` and ``gemma`` their decoder layers
(Phi-3's packed qkv and gate/up projections, a SwiGLU of 2,048; Gemma's GeGLU), ``t5-attention`` T5's
self-attention with its relative position bias, ``gpt2-model`` and ``llama-model`` whole 2-layer models (a
vocabulary of 32,000) called with 128 token ids.  Per thread mode and dtype a child process (``1``: one thread pinned to one core;
``all``: every core; the same environment as ``cpu_peers.py``) plans the layer with ``planner.plan(...,
backend="cpu")``, checks the planned call against eager torch within the dtype's tolerance, then times eager,
torch.compile (inductor) and the planned call in interleaved rounds (three calls each, the order rotating); a
figure is the median in µs.  On every core each turn first runs its contender untimed for ``cpu_peers.SETTLE_S``
(another library's spinning workers, or this one's sleeping ones, would slow its first calls).  The report lists how many kernels of the plan are Opaque torch calls.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from cpu_peers import _time_us, bf16_units, child_env, run_child, settle, versions

LAYERS = ("gpt2", "bert", "vit", "llama", "bert-masked", "llama-gqa", "phi3", "gemma", "t5-attention", "gpt2-model",
          "llama-model")
#: whole models called with token ids (2 layers, a vocabulary of 32,000): their last hidden states
MODELS = ("gpt2-model", "llama-model")
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
    else:
        model = transformers.LlamaModel(transformers.LlamaConfig(
            hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=2048,
            num_hidden_layers=2, vocab_size=32000, attn_implementation="sdpa"))

    class LastHidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).last_hidden_state

    kind = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    return LastHidden().eval().to(kind), torch.randint(0, 32000, (1, SEQ))


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


def steady(name: str, dtype: str, rounds: int, mode: str) -> dict[str, Any]:
    import torch

    import planner
    from planner.core.tolerance import allclose_report

    module, x = build_layer(name, dtype)
    result = planner.plan(module, (x,), backend="cpu")
    compiled = torch.compile(module)
    calls = {"torch": lambda: module(x), "torch.compile": lambda: compiled(x), "fp.call": lambda: result(x)}
    with torch.no_grad():
        want = module(x).float().numpy()
        ok, max_abs, _ = allclose_report(result(x).float().numpy(), want, dtype)
        if not ok:
            raise SystemExit(f"{name} {dtype}: the planned call differs from eager torch (max abs {max_abs:.3g})")
        for fn in calls.values():
            fn(), fn()
        samples: dict[str, list[float]] = {c: [] for c in calls}
        order = list(calls)
        for r in range(rounds):
            for c in order[r % len(order):] + order[: r % len(order)]:
                settle(mode, calls[c])
                samples[c] += _time_us(calls[c], 3)
    kinds = [k.kind for k in result.plan.kernels]
    return {"layer": name, "dtype": dtype, "median_us": {c: statistics.median(v) for c, v in samples.items()},
            "kernels": len(kinds), "opaque": kinds.count("opaque"), "composition": result.plan.composition()}


def report(rows: dict[str, list[dict[str, Any]]], command: str) -> str:
    from planner.core.machine import cpu_model

    lines = [
        "# Layers of the transformers package: fusion-planner against eager torch and torch.compile", "",
        f"Command: `{command}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}, CPUs as the modes say), Python {platform.python_version()}  ",
        f"Date: {datetime.date.today().isoformat()}  ",
        f"Versions: {versions()}  ",
        f"bf16 GEMMs and attention: {bf16_units()}", "",
        "Method: benchmarks/transformers_layers.py's docstring. Medians in µs; a ratio is the peer's time over "
        "the planned call's (> 1: fusion-planner is faster).", "",
    ]
    for mode, per in rows.items():
        lines += [f"## {'one thread, pinned' if mode == '1' else 'all cores'}", "",
                  "| layer | dtype | torch | torch.compile | fp call | vs torch | vs torch.compile | Opaque kernels | plan |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in per:
            m = row["median_us"]
            lines.append(f"| {row['layer']} | {row['dtype']} | {m['torch']:,.0f} | {m['torch.compile']:,.0f} | "
                         f"{m['fp.call']:,.0f} | {m['torch'] / m['fp.call']:.2f} | {m['torch.compile'] / m['fp.call']:.2f} | "
                         f"{row['opaque']} of {row['kernels']} | {row['composition']} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default="1,all", help="thread modes: 1 (one pinned thread), all (every core)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(steady(args.child[0], args.child[1], args.rounds, args.child[2])))
        return
    cores = os.sched_getaffinity(0)
    rows: dict[str, list[dict[str, Any]]] = {}
    for mode in args.modes.split(","):
        rows[mode] = []
        with tempfile.TemporaryDirectory() as caches:
            env = child_env(mode, Path(caches))
            for name in args.layers.split(","):
                for dtype in args.dtypes.split(","):
                    print(f"[{mode}] {name} {dtype}", file=sys.stderr)
                    rows[mode].append(run_child(["--rounds", str(args.rounds), "--child", name, dtype, mode], env,
                                                {max(cores)} if mode == "1" else None, __file__))
    text = report(rows, ("python benchmarks/transformers_layers.py " + " ".join(sys.argv[1:])).strip())
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

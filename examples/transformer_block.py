"""A pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(.)), causal multi-head attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, hidden: int = 256) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(batch: int = 2, seq: int = 16, d_model: int = 64, heads: int = 4, hidden: int | None = None,
          dtype: str = "fp32") -> tuple[nn.Module, tuple[torch.Tensor]]:
    """``fusion-planner plan --torch examples/transformer_block.py:build --torch-arg d_model=768 --torch-arg heads=12``."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
    torch.manual_seed(0)
    block = Block(d_model, heads, hidden or 4 * d_model).eval().to(_DTYPES[dtype])
    return block, (torch.randn(batch, seq, d_model, dtype=_DTYPES[dtype]),)

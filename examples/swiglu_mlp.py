"""A SwiGLU feed-forward block (LLaMA style): ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 172) -> None:
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def build(batch: int = 4, seq: int = 16, d: int = 64, hidden: int = 172) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return SwiGLU(d, hidden).eval(), (torch.randn(batch, seq, d),)

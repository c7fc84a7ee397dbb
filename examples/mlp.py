"""Linear -> GELU -> Linear with a residual: ``fusion-planner explain --torch examples/mlp.py:build``."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 256, approximate: str = "tanh") -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))) + x


def build(batch: int = 4, seq: int = 16, d: int = 64, hidden: int = 256) -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return MLP(d, hidden).eval(), (torch.randn(batch, seq, d),)

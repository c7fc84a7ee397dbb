"""Wrappers that call a layer of the ``transformers`` package as a plan takes it: one tensor in, one out."""

from __future__ import annotations

import torch
from torch import nn


class FirstOutput(nn.Module):
    """A decoder layer (with its rotary embedding, where it has one) or an attention module: its hidden states
    (a transformers layer returns a tuple or a tensor, by version)."""

    def __init__(self, layer: nn.Module, rope: nn.Module | None = None) -> None:
        super().__init__()
        self.layer, self.rope = layer, rope

    def forward(self, x):
        if self.rope is None:
            out = self.layer(x)
        else:
            pos = torch.arange(x.shape[1]).unsqueeze(0)
            out = self.layer(x, position_embeddings=self.rope(x, pos), position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

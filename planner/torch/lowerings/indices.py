"""Lowerings of calls that read token ids: the embedding lookup that starts a language model."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from planner.torch.binding import INDEX_DTYPES, TORCH_DTYPES
from planner.torch.lowerings.registry import lowering
from planner.torch.walk import (
    Importer,
    Traced,
    is_leaf_tensor,
)

#: the functional form's arguments after (ids, table), and the defaults that make it a plain lookup
_FUNCTIONAL_DEFAULTS = {"padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False,
                        "sparse": False}


@lowering("embedding", becomes="Embedding (a table's rows at token ids)")
def lower_embedding(imp: Importer, node: fx.Node, args: Any, kwargs: Any, concrete: Any) -> Any:
    """``F.embedding(ids, table)`` (``nn.Embedding``), or ``aten.embedding(table, ids)``: the rows of a float table
    at integer ids the plan takes (a call input, or a view of one). ``max_norm`` (which rewrites the table in
    place) stays torch's; ``padding_idx`` changes only gradients."""
    aten = isinstance(node.target, torch._ops.OpOverload)
    ids, table = (args[1], args[0]) if aten else (args[0], kwargs.get("weight", args[1] if len(args) > 1 else None))
    if not aten:
        extra = dict(zip(list(_FUNCTIONAL_DEFAULTS)[:max(0, len(args) - 2)], args[2:], strict=False))
        extra.update({k: v for k, v in kwargs.items() if k != "weight"})
        if extra.get("max_norm") is not None:
            return None
    if not (isinstance(ids, Traced) and ids.dtype in INDEX_DTYPES and ids.program is None and is_leaf_tensor(table)
            and table.dtype in TORCH_DTYPES and len(table.shape) == 2 and isinstance(concrete, torch.Tensor)):
        return None
    name = table.name if isinstance(table, Traced) else f"{node.name}_table"
    return imp.emit(node, "Embedding", [imp.use(ids, f"{node.name}_ids"), imp.use(table, name)], None,
                    concrete.shape, concrete.dtype)

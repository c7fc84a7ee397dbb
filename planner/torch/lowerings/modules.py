"""The lowering of a module the tracer keeps as a leaf (``nn.Linear``, ``nn.LayerNorm``, activations, dropout)."""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from planner.torch.errors import TorchImportError
from planner.torch.lowerings.elementwise import lower_gelu
from planner.torch.lowerings.layouts import alias
from planner.torch.lowerings.products import lower_linear
from planner.torch.lowerings.rows import norm
from planner.torch.walk import (
    Importer,
    Traced,
)


def lower_module(imp: Importer, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    m = imp.gm.get_submodule(str(node.target))
    concrete = imp.values[node]
    if not isinstance(m, (nn.ReLU, nn.SiLU, nn.GELU, nn.Dropout, nn.Identity)):  # these keep a channels-last layout
        args = imp.plain(args)
    x = args[0]
    if not isinstance(x, Traced) or not x.runtime:  # computed at import from the module's own state
        imp.folded_from.update(f"{node.target}.{k}" for k, _ in (*m.named_parameters(), *m.named_buffers()))
        return imp.fold(node, concrete)

    def state(attr: str) -> Traced | None:
        t = getattr(m, attr, None)
        if t is None:
            return None
        key = f"{node.target}.{attr}"
        return Traced(tuple(t.shape), t.dtype, False, source=("state", key), name=key)

    if isinstance(m, nn.Linear):
        return lower_linear(imp, node, (x, state("weight"), state("bias")), {}, concrete)
    if isinstance(m, nn.GELU):
        return lower_gelu(imp, node, (x,), {"approximate": m.approximate}, concrete)
    if isinstance(m, nn.ReLU):
        return imp.unary(node, "Relu", x, concrete)
    if isinstance(m, nn.SiLU):
        return imp.unary(node, "Silu", x, concrete)
    if isinstance(m, (nn.Dropout, nn.Identity)):
        if isinstance(m, nn.Dropout) and m.training and m.p:
            raise TorchImportError(f"{imp.where(node)}: dropout in training mode is random; call module.eval() first")
        return alias(imp, x, concrete)
    assert isinstance(m, nn.LayerNorm)
    call_args = (x, tuple(m.normalized_shape), state("weight"), state("bias"), float(m.eps))
    return (norm(imp, node, *call_args, concrete, rms=False)
            or imp.opaque_call(node, "torch.nn.functional.layer_norm", call_args, {}, concrete))

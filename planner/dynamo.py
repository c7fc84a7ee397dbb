"""``torch.compile(model, backend="fusion_planner")``: plan each captured graph, run the plan.

Registered through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), and under
that name when this module is imported. It plans through the same pipeline as
``planner.plan``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from planner.api import plan
from planner.registry import auto_backend
from planner.torch.errors import TorchImportError
from planner.torch.importer import INDEX_DTYPES, TORCH_DTYPES, import_fx_graph

log = logging.getLogger(__name__)


def dynamo_backend(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(model, backend="fusion_planner", options={...})``: plan the captured graph and run the
    plan; ``options`` are ``planner.plan``'s keywords (``backend``, ``max_candidates``, ...)."""
    options = {**(kwargs.pop("options", None) or {}), **kwargs}

    dynamic = [i for i, t in enumerate(example_inputs) if not isinstance(t, torch.Tensor)]
    if dynamic:
        raise TorchImportError(
            f"the captured graph has dynamic shapes (input {dynamic[0]} is a {type(example_inputs[dynamic[0]]).__name__}); "
            "a plan is made for fixed shapes: use torch.compile(model, backend='fusion_planner', dynamic=False) "
            "so that each new shape is planned on its own"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in example_inputs):
        log.info("fusion_planner: the captured graph needs autograd (an input requires grad); a plan computes no "
                 "gradients, so it runs eagerly")
        return gm.forward
    unplannable = [i for i, t in enumerate(example_inputs) if t.dtype not in TORCH_DTYPES and t.dtype not in INDEX_DTYPES]
    if unplannable:  # e.g. a boolean mask; the planner takes floating-point tensors and integer indices only
        i = unplannable[0]
        log.warning("fusion_planner: graph input %d is %s (the planner takes float32, float16 and bfloat16 tensors, "
                    "and int64/int32 indices); this captured graph runs eagerly", i,
                    str(example_inputs[i].dtype).removeprefix("torch."))
        return gm.forward
    try:
        imported = import_fx_graph(gm, example_inputs)
    except TorchImportError as exc:
        if "is empty" in str(exc):  # a graph break left no op to plan
            log.info("fusion_planner: captured graph has no ops; running it eagerly")
        else:  # compiling must not fail on what the planner cannot take: torch runs this graph, and says why
            log.warning("fusion_planner: cannot plan the captured graph (%s); it runs eagerly", exc)
        return gm.forward
    backend = options.pop("backend", None) or auto_backend()
    # compiling happens on the first call: keep the measured search short unless told otherwise
    opts: dict[str, Any] = {} if backend == "reference" else {"max_candidates": 16, "time_budget_s": 10.0}
    opts.update(options)
    result = plan(imported, example_inputs, backend=backend, **opts)
    with torch.no_grad():
        result.check(gm(*example_inputs), *example_inputs)
    log.info("fusion_planner: planned %s on %s backend: %s", gm.__class__.__name__, backend, result.plan.composition())

    def run(*args: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args):
            return gm(*args)  # this call needs gradients, which the plan does not compute
        return result(*args)

    run.plan_result = result  # type: ignore[attr-defined]
    return run


def _register_dynamo() -> None:
    """Make ``backend="fusion_planner"`` work after ``import planner.dynamo`` too."""
    try:
        from torch._dynamo.backends.registry import _BACKENDS, register_backend

        if "fusion_planner" not in _BACKENDS:
            register_backend(name="fusion_planner")(dynamo_backend)
    except ImportError:  # a torch without dynamo: only the entry point remains
        pass


_register_dynamo()


__all__ = ["dynamo_backend"]

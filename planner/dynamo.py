"""``torch.compile(model, backend="fusion_planner")``: plan each captured graph, run the plan.

Registered through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), and under
that name when this module is imported. It plans through the same pipeline as
``planner.plan``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from planner.api import PlanResult, plan
from planner.registry import auto_backend
from planner.torch.errors import TorchImportError
from planner.torch.importer import INDEX_DTYPES, TORCH_DTYPES, import_fx_graph

log = logging.getLogger(__name__)


def dynamo_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """``torch.compile(model, backend="fusion_planner", options={...})``: plan the captured graph and run the
    plan; ``options`` are ``planner.plan``'s keywords (``backend``, ``max_candidates``, ...). A graph captured
    with dynamic shapes (``dynamic=True``, ``mark_dynamic``, or torch.compile's default once a size changed) is
    planned for each concrete shape it is called with, up to :data:`MAX_PLANS`, then runs eagerly; whatever
    cannot be planned runs eagerly, with the reason logged. Compiling never fails on the planner's account."""
    options = {**(kwargs.pop("options", None) or {}), **kwargs}
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        log.info("fusion_planner: the captured graph needs autograd (an input requires grad); a plan computes no "
                 "gradients, so it runs eagerly")
        return gm.forward
    unplannable = [t for t in tensors if t.dtype not in TORCH_DTYPES and t.dtype not in INDEX_DTYPES]
    if unplannable:  # e.g. a boolean mask; the planner takes floating-point tensors and integer indices only
        log.warning("fusion_planner: a graph input is %s (the planner takes float32, float16 and bfloat16 tensors, "
                    "and int64/int32 indices); this captured graph runs eagerly",
                    str(unplannable[0].dtype).removeprefix("torch."))
        return gm.forward
    runner = ShapePlans(gm, options)
    if all(isinstance(v, (torch.Tensor, int)) for v in example_inputs):
        runner.plan_for(tuple(example_inputs))  # static shapes: plan now, as compiling is expected to
    return runner


#: plans one captured graph keeps, one per concrete shape, before it runs eagerly (dynamo's recompile limit)
MAX_PLANS = 8


class ShapePlans:
    """A captured graph's plans, one per concrete input shape (and value of each size input), made on first use."""

    def __init__(self, gm: fx.GraphModule, options: dict[str, Any]) -> None:
        self.gm = gm
        self.backend = options.pop("backend", None) or auto_backend()
        # compiling happens on the first call: keep the measured search short unless told otherwise
        self.options: dict[str, Any] = {} if self.backend == "reference" else {"max_candidates": 16,
                                                                                "time_budget_s": 10.0}
        self.options.update(options)
        self.plans: dict[tuple[Any, ...], PlanResult | None] = {}
        self._planning = threading.Lock()  # a shape planned once, when calls from several threads meet it

    def __call__(self, *args: Any) -> Any:
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args):
            return self.gm(*args)  # this call needs gradients, which the plan does not compute
        key = _shape_key(args)
        if key not in self.plans:
            with self._planning:
                if key not in self.plans:
                    self.plan_for(args)
        result = self.plans[key]
        if result is None:
            return self.gm(*args)
        return result(*[a for a in args if isinstance(a, torch.Tensor)])

    @property
    def plan_result(self) -> PlanResult | None:
        """The first plan made (the graph's only one when its shapes are static)."""
        return next((p for p in self.plans.values() if p is not None), None)

    def plan_for(self, args: tuple[Any, ...]) -> None:
        key = _shape_key(args)
        if len([p for p in self.plans.values() if p is not None]) >= MAX_PLANS:
            log.warning("fusion_planner: %d shapes planned for this graph already; inputs %s run eagerly",
                        MAX_PLANS, _describe(args))
            self.plans[key] = None
            return
        try:
            self.plans[key] = self._plan(args)
        except TorchImportError as exc:
            if "is empty" in str(exc):  # a graph break left no op to plan
                log.info("fusion_planner: captured graph has no ops; running it eagerly")
            else:
                log.warning("fusion_planner: cannot plan the captured graph for %s (%s); it runs eagerly",
                            _describe(args), exc)
            self.plans[key] = None
        except Exception as exc:  # compiling must not fail on the planner's account: torch runs it, and says why
            log.warning("fusion_planner: planning the captured graph for %s failed (%s: %s); it runs eagerly",
                        _describe(args), type(exc).__name__, exc)
            self.plans[key] = None

    def _plan(self, args: tuple[Any, ...]) -> PlanResult:
        imported = import_fx_graph(self.gm, args)
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        result = plan(imported, tensors, backend=self.backend, **self.options)
        with torch.no_grad():
            result.check(self.gm(*args), *tensors)
        log.info("fusion_planner: planned %s for %s on %s backend: %s", self.gm.__class__.__name__, _describe(args),
                 self.backend, result.plan.composition())
        return result


def _shape_key(args: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else ("value", int(a))
                 if isinstance(a, int) else ("other", repr(a)[:100]) for a in args)


def _describe(args: Sequence[Any]) -> str:
    return ", ".join(f"{list(a.shape)} {str(a.dtype).removeprefix('torch.')}" if isinstance(a, torch.Tensor) else
                     str(a) for a in args)


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

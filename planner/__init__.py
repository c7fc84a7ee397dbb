"""fusion-planner: operator-fusion planning with an e-graph and a three-ledger cost model.

``planner.plan(model, example_inputs)`` is the Python entry point (see
:mod:`planner.api`); torch is imported only when a torch model is planned.
"""

from __future__ import annotations

from typing import Any


def plan(module_or_graph: Any, example_inputs: Any = None, backend: str = "cpu", device: Any = None, **opts: Any) -> Any:
    """Plan a torch module or an IR graph; see :func:`planner.api.plan`."""
    from planner.api import plan as _plan

    return _plan(module_or_graph, example_inputs, backend=backend, device=device, **opts)


__all__ = ["plan"]

"""The registry of lowerings: each kind of ``IMPORTER_TABLE`` (``planner.torch.ops``) and the function that emits
its op-table ops."""

from __future__ import annotations

from collections.abc import Callable

from planner.torch.walk import (
    Lowering,
)

#: the lowering of each kind of IMPORTER_TABLE
LOWERINGS: dict[str, Lowering] = {}


def lowering(*kinds: str) -> Callable[[Lowering], Lowering]:
    """Register a function as the lowering of ``kinds``."""

    def register(fn: Lowering) -> Lowering:
        for kind in kinds:
            if kind in LOWERINGS:
                raise ValueError(f"torch call kind {kind!r} has a lowering already ({LOWERINGS[kind].__name__})")
            LOWERINGS[kind] = fn
        return fn

    return register
